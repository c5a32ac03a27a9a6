"""API keys end to end: a real stack (router, metrics collector, orchestrator, a sim
worker, each a process, on the session's nats-server) whose router and collector read a
key file, driven by the official `openai` client.

No key or a wrong one is a 401, the right one a 200; a key over its rate a 429 whose
`Retry-After` comes from its bucket, over its concurrency a 429 with `Retry-After: 1`; a
key removed from the file while the router runs is refused without a restart. The key's
name (never the key) is on the request's span and in the metrics; the keys appear in no
log and on no command line.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from bench.serve.prompts import PromptSpec
from bench.serve.run import ServeWorkload, run_serve
from cli.status import StatusError, fetch_status
from launch.stack import LocalStack
from shared.api_keys import ApiKey, KeyTable, hash_key
from shared.api_keys_file import new_key, write_key_file
from shared.nats_server import EmbeddedNats
from tests.e2e.api_key_helpers import keyed_client, wait_served
from tests.e2e.conftest import make_stack
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

NAMES = ("alice", "slow", "pair", "doomed")
LIMITS = {"slow": {"rps": 0.2, "burst": 1}, "pair": {"max_concurrent": 1}}


class Keys:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.plain = {name: new_key() for name in NAMES}

    def write(self, names: tuple[str, ...] = NAMES) -> None:
        write_key_file(self.path, KeyTable(tuple(ApiKey(name=name, sha256=hash_key(self.plain[name]),
                                                        **LIMITS.get(name, {})) for name in names)))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    keys = Keys(tmp_path_factory.mktemp("keys") / "api-keys.jsonl")
    keys.write()
    return keys


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
          keys: Keys, receiver: OtlpReceiver) -> Iterator[LocalStack]:
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)
    planned = make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("auth-stack"), workers=1,
                         router_args=("--api-keys-file", str(keys.path), *tracing))
    config = msgspec.structs.replace(planned.config, metrics_settings={"api_keys_file": str(keys.path)})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the router exports its spans every 100 ms
        with running(LocalStack(config)) as local:
            yield local


client = functools.partial(keyed_client, timeout_s=30)


async def complete(stack: LocalStack, api_key: str, model: str, max_tokens: int = 3):
    async with client(stack, api_key) as api:
        return await api.completions.with_raw_response.create(model=model, prompt="Hello there", max_tokens=max_tokens)


async def test_no_key_or_a_wrong_key_is_refused_with_a_challenge(stack: LocalStack, keys: Keys, model: str) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{stack.router_url}/v1/completions", json={"model": model, "prompt": "x"})
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "missing_key" and "Bearer" in error["message"]
        for probe in ("/health", "/ready", "/metrics"):  # probes and scrapers need no key (metrics_auth open)
            assert (await http.get(stack.router_url + probe)).status_code == 200, probe
        assert (await http.get(f"{stack.router_url}/v1/models")).status_code == 401
    with pytest.raises(openai.AuthenticationError) as refused:
        await complete(stack, "tdm_" + "x" * 43, model)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_key"
    assert refused.value.response.headers["www-authenticate"].startswith("Bearer")


async def test_the_right_key_is_served_and_named_on_its_span_and_in_the_metrics(
        stack: LocalStack, keys: Keys, model: str, receiver: OtlpReceiver) -> None:
    raw = await complete(stack, keys.plain["alice"], model)
    assert raw.http_response.status_code == 200 and raw.parse().usage.completion_tokens == 3
    trace_id = raw.headers["x-trace-id"]
    await wait_for(lambda: any(span.name == "POST /v1/completions" for span in receiver.trace(trace_id)), 10,
                   "the request's HTTP span exported")
    http_span = next(span for span in receiver.trace(trace_id) if span.name == "POST /v1/completions")
    assert http_span.attributes["tandem.api_key"] == "alice"
    async with httpx.AsyncClient(timeout=10) as http:
        exposition = (await http.get(f"{stack.router_url}/metrics")).text
    assert 'tandem_router_api_key_requests_total{key="alice",outcome="accepted"}' in exposition
    assert 'tandem_router_auth_rejected_requests_total{reason="invalid_key"}' in exposition
    assert not any(key in exposition for key in keys.plain.values())


async def test_a_key_over_its_rate_gets_429_with_retry_after_from_its_bucket(
        stack: LocalStack, keys: Keys, model: str) -> None:
    await complete(stack, keys.plain["slow"], model)  # its one token (0.2 req/s, burst 1)
    with pytest.raises(openai.RateLimitError) as limited:
        await complete(stack, keys.plain["slow"], model)
    assert limited.value.code == "rate_limited"
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 5  # the next token within 5 s
    async with httpx.AsyncClient(timeout=10) as http:
        exposition = (await http.get(f"{stack.router_url}/metrics")).text
    assert 'tandem_router_api_key_requests_total{key="slow",outcome="rate_limited"} 1.0' in exposition


async def test_a_key_over_its_concurrency_gets_429_until_its_request_ends(
        stack: LocalStack, keys: Keys, model: str) -> None:
    async with client(stack, keys.plain["pair"]) as api:
        stream = await api.completions.create(model=model, prompt="Tell me a long story", max_tokens=400,
                                              stream=True)
        first = await anext(aiter(stream))  # the request is in flight
        assert first.choices
        with pytest.raises(openai.RateLimitError) as limited:
            await api.completions.create(model=model, prompt="Another", max_tokens=2)
        assert limited.value.code == "concurrency_limited"
        assert limited.value.response.headers["retry-after"] == "1"
        await stream.close()  # the router cancels it and frees the key's slot

        await wait_served(api, model, "Another", "the key's slot freed once its stream was closed")


async def test_a_key_removed_from_the_file_is_refused_without_a_restart(
        stack: LocalStack, keys: Keys, model: str) -> None:
    await complete(stack, keys.plain["doomed"], model)
    router_pid = stack.processes["router"].pid
    keys.write(tuple(name for name in NAMES if name != "doomed"))

    async def refused() -> bool:
        try:
            await complete(stack, keys.plain["doomed"], model)
        except openai.AuthenticationError:
            return True
        return False

    waited = await wait_for(refused, 5, "the revoked key refused", interval_s=0.1)
    assert waited < 3.0  # the file is checked every second
    assert stack.processes["router"].pid == router_pid and stack.processes["router"].alive
    assert (await complete(stack, keys.plain["alice"], model)).http_response.status_code == 200
    keys.write()  # back, for whatever runs after
    await wait_for(lambda: _served(stack, keys.plain["doomed"], model), 5, "the key back", interval_s=0.1)


async def _served(stack: LocalStack, api_key: str, model: str) -> bool:
    try:
        await complete(stack, api_key, model)
    except openai.AuthenticationError:
        return False
    return True


async def test_the_collector_pages_need_a_key(stack: LocalStack, keys: Keys) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        for path in ("/cluster", "/cluster/page", "/"):
            refused = await http.get(stack.metrics_url + path)
            assert refused.status_code == 401, path
            assert any(value.startswith("Basic") for value in refused.headers.get_list("www-authenticate"))
        bearer = {"Authorization": f"Bearer {keys.plain['alice']}"}
        assert (await http.get(stack.metrics_url + "/cluster", headers=bearer)).json()["totals"]["workers"] == 1
        basic = {"Authorization": "Basic " + base64.b64encode(f"me:{keys.plain['alice']}".encode()).decode()}
        assert (await http.get(stack.metrics_url + "/cluster/page", headers=basic)).status_code == 200
        wrong = {"Authorization": "Bearer tdm_wrong"}
        assert (await http.get(stack.metrics_url + "/cluster", headers=wrong)).status_code == 401
        for probe in ("/health", "/metrics"):
            assert (await http.get(stack.metrics_url + probe)).status_code == 200, probe
    assert fetch_status(stack.metrics_url, api_key=keys.plain["alice"])[1].totals.workers == 1  # tandem status
    with pytest.raises(StatusError, match="needs an API key"):
        fetch_status(stack.metrics_url)


async def test_bench_serve_sends_its_key(stack: LocalStack, keys: Keys) -> None:
    workload = ServeWorkload(prompts=PromptSpec(count=3, prompt_tokens=20), max_tokens=4, warmup=0)
    _, results = await run_serve(stack.router_url, workload, api_key=keys.plain["alice"])
    assert (results["requests"], results["errors"]) == (3, 0), results["error_kinds"]
    with pytest.raises(httpx.HTTPStatusError):  # without it, the model list is refused
        await run_serve(stack.router_url, workload)


async def test_no_key_in_any_log_or_command_line(stack: LocalStack, keys: Keys, model: str) -> None:
    await complete(stack, keys.plain["alice"], model)
    for name, process in stack.processes.items():
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace")
        log = process.log_path.read_text(errors="replace")
        for key in keys.plain.values():
            assert key not in command_line, f"a key on {name}'s command line"
            assert key not in log and hash_key(key) not in log, f"a key in {name}'s log"
