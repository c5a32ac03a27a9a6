"""The compose file on a real Docker engine, default profile (sim engine): secure by default
(the router wants the API key the secrets service made, NATS refuses anonymous clients, no
secret shows in the compose configuration or the containers' settings), the OpenAI API on
the published port through a prefill/decode pair, every worker under its own worker slot
whose credentials cannot read another worker's requests nor drain it, a decode worker added
with `--scale` claiming a slot of its own and taking traffic, a worker stopped mid-request
draining with no failed request and, started again, claiming a slot again, and `down -v`
leaving nothing behind. The tests run in order on one stack."""

from __future__ import annotations

import json
import random
import string
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.compose.docker_stack import ComposeStack, http_json, http_text, run

pytestmark = pytest.mark.timeout(900)

# Longer than the router's local_prefill_tokens (256): a prompt this long goes prefill -> decode.
PROMPT_WORDS = 100  # ~500 tokens of the tiny tokenizer


def long_prompt() -> str:
    """A prompt nothing has cached yet (random words), so it disaggregates."""
    rng = random.Random()
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(PROMPT_WORDS))


_KEYS: dict[str, str] = {}


def client(stack: ComposeStack, api_key: str = "") -> openai.OpenAI:
    """An OpenAI client with the stack's API key (read once from its volume), or `api_key`."""
    if not api_key:
        api_key = _KEYS.get(stack.project) or _KEYS.setdefault(stack.project, stack.api_key())
    return openai.OpenAI(base_url=stack.router_url + "/v1", api_key=api_key, timeout=120, max_retries=0)


def test_the_router_wants_the_api_key_from_the_secrets_volume(sim_stack: ComposeStack) -> None:
    mode = sim_stack.exec("router", "stat", "-c", "%a", "/secrets/api-key").stdout.strip()
    assert mode == "600"
    with pytest.raises(openai.AuthenticationError):
        client(sim_stack, api_key="none").completions.create(model="tiny", prompt="hello", max_tokens=2)
    status, _ = http_json(sim_stack.router_url + "/v1/models")
    assert status == 401  # no key at all
    assert http_json(sim_stack.router_url + "/ready")[0] == 200  # probes stay open
    reply = client(sim_stack).completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_a_second_run_of_the_secrets_service_keeps_the_secrets(sim_stack: ComposeStack) -> None:
    key = client(sim_stack).api_key
    again = sim_stack.compose("run", "--rm", "secrets", timeout_s=120)
    assert "(kept)" in again.stdout and key not in again.stdout + again.stderr
    assert sim_stack.api_key() == key


ANONYMOUS_NATS = """
import asyncio, ssl, nats
async def attempt(**options):
    try:
        client = await nats.connect("nats://nats:4222", allow_reconnect=False, connect_timeout=3,
                                    max_reconnect_attempts=0, **options)
    except Exception as error:
        return "refused: " + type(error).__name__
    await client.close()
    return "connected"
async def main():
    tls = ssl.create_default_context(cafile="/secrets/nats/tls/ca-cert.pem")
    print(await attempt())  # plain, no user
    print(await attempt(tls=tls, tls_handshake_first=True))  # TLS, no client certificate, no user
asyncio.run(main())
"""


def test_nats_refuses_anonymous_clients(sim_stack: ComposeStack) -> None:
    """From inside the compose network (the NATS port is not published)."""
    result = sim_stack.exec("router", "python", "-c", ANONYMOUS_NATS)
    lines = result.stdout.split()
    assert result.stdout.count("refused") == 2 and "connected" not in lines, result.stdout + result.stderr


def test_no_secret_in_the_compose_configuration_or_the_containers(sim_stack: ComposeStack) -> None:
    secrets = [client(sim_stack).api_key]
    for user in ("router", "worker-w01", "worker-w02", "orchestrator", "metrics", "operator"):
        creds = sim_stack.exec("router", "cat", f"/secrets/nats/creds/{user}.creds").stdout
        secrets.append(creds.split('password = "', 1)[1].split('"', 1)[0])
    assert all(len(secret) >= 32 for secret in secrets)
    config = sim_stack.compose("config").stdout
    ids = sim_stack.compose("ps", "-q", "-a").stdout.split()
    inspected = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout
    assert len(json.loads(inspected)) >= 6  # secrets, nats, model, orchestrator, metrics, router, workers
    for secret in secrets:
        assert secret not in config and secret not in inspected
    router_env = sim_stack.exec("router", "env").stdout
    assert "TANDEM_API_KEYS_FILE=/secrets/api-keys.jsonl" in router_env
    assert "TANDEM_NATS_CREDS_FILE=/secrets/nats/creds/router.creds" in router_env
    assert not any(secret in router_env for secret in secrets)
    worker_env = sim_stack.exec("decode", "env").stdout
    assert "TANDEM_NATS_" not in worker_env  # a worker finds its files through the slot it claims
    assert not any(secret in worker_env for secret in secrets)


def test_openai_api_through_a_prefill_decode_pair(sim_stack: ComposeStack) -> None:
    sim_stack.wait_router_workers(2)  # the prefill worker too, or a request is served by the decode worker alone
    api = client(sim_stack)
    model = api.models.list().data[0].id
    before = sim_stack.router_metric("tandem_router_disaggregated_requests_total")

    reply = api.completions.create(model=model, prompt=long_prompt(), max_tokens=8)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    stream = api.completions.create(model=model, prompt=long_prompt(), max_tokens=8, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1

    chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": long_prompt()}],
                                       max_tokens=8)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    chunks = list(api.chat.completions.create(model=model, messages=[{"role": "user", "content": long_prompt()}],
                                              max_tokens=8, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason == "length"

    # Each of the four went prefill -> decode, and the decode worker pulled the prompt's KV.
    decisions = [line for line in http_text(sim_stack.router_url + "/metrics").splitlines()
                 if line.startswith("tandem_router_route_decisions_total")]
    assert sim_stack.router_metric("tandem_router_disaggregated_requests_total") - before == 4, \
        f"route decisions: {decisions}\n{sim_stack.logs('router', 'prefill', 'decode')}"
    assert sim_stack.router_metric("tandem_router_kv_pulled_tokens_total") > 4 * 256
    decode = list(sim_stack.workers("decode").values())
    assert len(decode) == 1 and decode[0]["kv_pulled_tokens_total"] > 0


SLOT_IDS = {f"w{index:02d}" for index in range(1, 9)}  # the default 8 worker slots

# With one worker slot's files (argv[1]), from inside the compose network: subscribe to
# another slot's generate requests (argv[2]), then to its own, then publish a drain to the
# other one; print what the server said to each. nats-py runs the error callback before it
# reads the answer to a later PING, so after two flushes every refusal has been seen.
AS_A_WORKER = """
import asyncio, ssl, sys, nats
from shared.nats_secrets import read_credentials
from shared.nats_security import user_files
from shared.subjects import Subjects
me, other = sys.argv[1], sys.argv[2]
subjects = Subjects("tandem")
files = user_files("/secrets/nats", "worker-" + me)
errors = []
async def on_error(error):
    errors.append(str(error))
async def outcome(action):
    errors.clear()
    await action()
    await client.flush()
    await client.flush()
    return "refused" if any("permissions violation" in error.lower() for error in errors) else "allowed"
async def main():
    global client
    creds = read_credentials(files["creds_file"])
    tls = ssl.create_default_context(cafile=files["tls_ca_file"])
    tls.load_cert_chain(files["tls_cert_file"], files["tls_key_file"])
    client = await nats.connect("nats://nats:4222", user=creds.user, password=creds.password, tls=tls,
                                tls_handshake_first=True, error_cb=on_error, allow_reconnect=False,
                                inbox_prefix="_INBOX.worker-" + me)
    print("read other:", await outcome(lambda: client.subscribe(subjects.generate(other))))
    print("read own:", await outcome(lambda: client.subscribe(subjects.generate(me))))
    print("drain other:", await outcome(lambda: client.publish(subjects.control(other, "drain"), b"")))
    await client.close()
asyncio.run(main())
"""


def test_each_worker_has_its_own_slot_whose_credentials_reach_no_other_worker(sim_stack: ComposeStack) -> None:
    (prefill,) = sim_stack.wait_workers("prefill", 1)
    (decode,) = sim_stack.wait_workers("decode", 1)
    assert prefill != decode and {prefill, decode} <= SLOT_IDS
    held = sim_stack.exec("decode", "ls", "/slots").stdout.split()
    assert sorted(held) == sorted(f"{slot}.lock" for slot in SLOT_IDS)
    result = sim_stack.exec("router", "python", "-c", AS_A_WORKER, prefill, decode)
    assert result.stdout.splitlines() == ["read other: refused", "read own: allowed", "drain other: refused"], \
        result.stdout + result.stderr
    # the decode worker was neither drained nor robbed of a request: it still serves
    reply = client(sim_stack).completions.create(model="tiny", prompt=long_prompt(), max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert set(sim_stack.workers("decode")) == {decode}


def test_a_scaled_decode_worker_receives_traffic(sim_stack: ComposeStack) -> None:
    first = set(sim_stack.workers("decode"))
    sim_stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "decode=2")
    assert len(sim_stack.containers("decode")) == 2
    sim_stack.wait_ready(serving_workers=2)
    (added,) = set(sim_stack.wait_workers("decode", 2)) - first
    assert added in SLOT_IDS and added not in sim_stack.workers("prefill")  # a slot of its own

    api = client(sim_stack)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: api.completions.create(model="tiny", prompt=long_prompt(), max_tokens=32),
                                range(16)))
    assert all(reply.usage.completion_tokens == 32 for reply in replies)
    sim_stack.wait_generated("decode", added, timeout_s=10)


def test_stopping_a_worker_drains_it(sim_stack: ComposeStack) -> None:
    """SIGTERM (docker stop) while requests stream from every decode worker: all finish."""
    api = client(sim_stack)
    containers = sim_stack.containers("decode")
    assert len(containers) == 2

    def stream_one(_: int) -> tuple[str | None, int]:
        stream = api.completions.create(model="tiny", prompt=long_prompt(), max_tokens=300, stream=True)
        reason, tokens = None, 0
        for chunk in stream:
            if chunk.choices:
                tokens += 1 if chunk.choices[0].text else 0
                reason = chunk.choices[0].finish_reason or reason
        return reason, tokens

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream_one, index) for index in range(8)]
        deadline = time.monotonic() + 30
        while not all(worker["running"] > 0 for worker in sim_stack.workers("decode").values()):
            assert time.monotonic() < deadline, f"requests never ran on both decode workers: " \
                                                f"{sim_stack.workers('decode')}"
            time.sleep(0.1)
        stopped = containers[0]
        started = time.monotonic()
        run(["docker", "stop", "--time", "60", stopped])  # SIGTERM: drain, then exit
        stop_s = time.monotonic() - started
        results = [future.result() for future in futures]

    assert [reason for reason, _ in results] == ["length"] * 8, results
    assert all(tokens > 0 for _, tokens in results)
    state = run(["docker", "inspect", "--format", "{{.State.ExitCode}} {{.State.OOMKilled}}", stopped]).stdout.split()
    assert state == ["0", "false"], f"the drained worker exited {state} after {stop_s:.1f} s"
    assert "draining" in run(["docker", "logs", stopped]).stderr + run(["docker", "logs", stopped]).stdout
    reply = api.completions.create(model="tiny", prompt=long_prompt(), max_tokens=4)  # the other one serves on
    assert reply.usage.completion_tokens == 4


def test_a_restarted_worker_claims_a_slot_again(sim_stack: ComposeStack) -> None:
    """The drained container's slot was let go with its process; started again, it takes one."""
    stopped = run(["docker", "ps", "-q", "--filter", "status=exited",
                   "--filter", f"label=com.docker.compose.project={sim_stack.project}",
                   "--filter", "label=com.docker.compose.service=decode"]).stdout.split()
    assert len(stopped) == 1
    run(["docker", "start", stopped[0]])
    sim_stack.wait_ready(serving_workers=2)
    workers = set(sim_stack.wait_workers("decode", 2)) | set(sim_stack.workers("prefill"))
    assert len(workers) >= 3 and workers <= SLOT_IDS


def test_down_leaves_nothing_behind(sim_stack: ComposeStack) -> None:
    assert sim_stack.leftovers()  # it ran: containers, a network, volumes
    down = sim_stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    assert sim_stack.leftovers() == {}, down.stdout + down.stderr
