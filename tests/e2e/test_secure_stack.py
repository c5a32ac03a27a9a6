"""The local stack on a secured NATS (`StackConfig.nats_security_dir`, what `tandem up`
does by default): a user per service with its own permissions, TLS with client
certificates.

- A disaggregated request goes router -> prefill -> decode (a KV pull) with every
  permission in force: no violation in the server's log nor in any service's.
- No secret (a password) appears on a process's command line or environment, in a log,
  or in `tandem up`'s status table; the status table shows no user in the NATS URL.
- A service NATS refuses (a wrong password, a missing credentials file) stops the
  stack's start at once with the service's one-line reason.
- `tandem up` itself, run as people run it: secured, serving, and no secret in `ps`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from rich.console import Console

from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack
from launch.up import UpOptions, _status_table, run_up
from shared.nats_secrets import Credentials, read_credentials, write_credentials
from shared.schemas import WorkerRole
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.test_disaggregated import metric, metrics_when
from tests.e2e.test_tandem_up import _descendants, _first_line
from tests.stack_fixtures import running

pytestmark = pytest.mark.e2e


def secure_stack(model_dir: str, state: Path, *specs: WorkerSpec) -> LocalStack:
    return LocalStack(StackConfig(
        model_dir=model_dir, workers=specs or (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL),
                                               WorkerSpec(worker_id="d1", role=WorkerRole.DECODE)),
        router_port=0, metrics_port=0, namespace="secure", heartbeat_interval_s=0.2, ttl_s=1.5,
        log_dir=str(state / "logs"), router_args=ALWAYS_DISAGGREGATE, nats_security_dir=str(state / "nats-auth")))


@pytest.fixture(scope="module")
def stack(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running(secure_stack(tiny_model_dir, tmp_path_factory.mktemp("secure-stack"))) as local:
        yield local


def secrets_of(stack_dir: Path) -> list[str]:
    passwords = [read_credentials(str(path)).password for path in (stack_dir / "creds").glob("*.creds")]
    assert len(passwords) >= 6, "a password per service"  # router, orchestrator, metrics, operator, workers
    return passwords


def process_texts(pid: int) -> str:
    """What `ps` and /proc show of a process: its command line and its environment."""
    texts = []
    for name in ("cmdline", "environ"):
        try:
            texts.append(Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return " ".join(texts)


def log_texts(log_dir: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in log_dir.rglob("*.log"))


async def test_a_disaggregated_request_passes_every_permission(stack: LocalStack, openai_client) -> None:
    assert stack.nats_url.startswith("tls://") and stack.nats_security is not None
    client = openai_client(stack.router_url)
    model = (await client.models.list()).data[0].id
    reply = await client.completions.create(model=model, prompt="Hello there " * 40, max_tokens=8)
    assert reply.usage.completion_tokens == 8
    stream = await client.completions.create(model=model, prompt="Stream " * 40, max_tokens=8, stream=True)
    assert [chunk async for chunk in stream if chunk.choices[0].finish_reason]

    async def collector() -> str:
        async with httpx.AsyncClient() as http:
            return (await http.get(stack.metrics_url + "/metrics")).text

    await metrics_when(collector, lambda text: metric(text, "tandem_kv_transfers_total", kind="pull",
                                                      outcome="done") >= 2,
                       lambda text: f"two KV pulls from the prefill worker: {metric(text, 'tandem_kv_transfers_total')}")
    logs = log_texts(Path(stack.config.log_dir))
    assert "permissions violation" not in logs.lower()
    assert "authorization violation" not in logs.lower()


def test_no_secret_in_process_lists_logs_or_the_status_table(stack: LocalStack) -> None:
    passwords = secrets_of(Path(stack.config.nats_security_dir))
    pids = [process.pid for process in stack.processes.values()] + [stack.nats.process.pid]
    shown = {pid: process_texts(pid) for pid in pids}
    assert all(shown.values()), "every process is readable"
    for pid, text in shown.items():
        assert not [p for p in passwords if p in text], f"a password on process {pid}'s command line or environment"
    logs = log_texts(Path(stack.config.log_dir))
    assert logs and not [p for p in passwords if p in logs]
    console = Console(record=True, width=200, file=open(os.devnull, "w"))
    console.print(_status_table(stack))
    table = console.export_text()
    assert "(users, TLS)" in table and stack.nats_url in table
    assert not [p for p in passwords if p in table] and "@" not in table


@pytest.mark.parametrize("problem", ["wrong password", "missing credentials"])
def test_a_refused_service_stops_the_start_with_its_reason(problem: str, tiny_model_dir: str, tmp_path: Path) -> None:
    if problem == "wrong password":
        creds = write_credentials(tmp_path / "wrong.creds", Credentials(user="worker-d1", password="not-it"))
        expected = f"refused the credentials in {creds} (authorization violation)"
    else:
        creds = tmp_path / "absent.creds"
        expected = f"error: NATS credentials file {creds} does not exist"
    stack = secure_stack(tiny_model_dir, tmp_path, WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL),
                         WorkerSpec(worker_id="d1", role=WorkerRole.DECODE,
                                    extra_args=("--nats-creds-file", str(creds))))
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        stack.start()  # stops what it started when it fails
    assert "d1 exited with 2" in str(caught.value)
    assert expected in str(caught.value).splitlines()[-1]  # the log's last line: the reason
    assert time.monotonic() - started < 45  # the start's timeout is the engine's (60 s): never reached


def test_tandem_up_is_secured_by_default_with_no_secret_in_ps(tmp_path: Path, tiny_model_dir: str) -> None:
    state = tmp_path / "state"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--port", "0", "--metrics-port", "0",
                               "--engine", "sim", "--model", tiny_model_dir, "--state-dir", str(state)],
                              stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              text=True, start_new_session=True)
    try:
        url = _first_line(up, 90)
        passwords = secrets_of(state / "nats-auth")
        pids = _descendants(up.pid)
        assert len(pids) >= 6  # nats, orchestrator, metrics, 2 workers, router
        for pid in pids + [up.pid]:
            assert not [p for p in passwords if p in process_texts(pid)], f"a password in process {pid}"
        api_key = (state / "api-key").read_text().strip()
        with openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=30) as client:
            model = client.models.list().data[0].id
            assert client.completions.create(model=model, prompt="Hi " * 50, max_tokens=4).usage.completion_tokens == 4
        # the operator's files let `tandem ctl` command the orchestrator, which commands the worker
        nats_url = re.search(r"tls://127\.0\.0\.1:\d+", (tmp_path / "stderr.txt").read_text()).group(0)
        auth = state / "nats-auth"
        operator = {"TANDEM_NATS_CREDS_FILE": str(auth / "creds" / "operator.creds"),
                    "TANDEM_NATS_CA_FILE": str(auth / "tls" / "ca-cert.pem"),
                    "TANDEM_NATS_CERT_FILE": str(auth / "tls" / "client-operator-cert.pem"),
                    "TANDEM_NATS_KEY_FILE": str(auth / "tls" / "client-operator-key.pem")}
        switched = subprocess.run([sys.executable, "-m", "cli.main", "ctl", "set-role", "prefill-1", "both",
                                   "--nats-url", nats_url], env={**os.environ, **operator}, capture_output=True,
                                  text=True, timeout=60)
        assert switched.returncode == 0, switched.stdout + switched.stderr
        assert "both" in switched.stdout
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(90)
    assert code == 0
    status = (tmp_path / "stderr.txt").read_text()
    assert "tls://127.0.0.1:" in status and "(users, TLS)" in status
    logs = log_texts(state / "logs")
    for text in (status, logs):
        assert not [p for p in passwords if p in text]
    assert "permissions violation" not in logs.lower()
    for key in (state / "nats-auth").rglob("*key.pem"):
        assert key.stat().st_mode & 0o777 == 0o600
    for creds in (state / "nats-auth" / "creds").glob("*.creds"):
        assert creds.stat().st_mode & 0o777 == 0o600


def test_tandem_up_refuses_a_password_in_the_nats_url(tmp_path: Path, tiny_model_dir: str, capsys) -> None:
    options = UpOptions(engine="sim", model=tiny_model_dir, nats_url="nats://admin:hunter2@127.0.0.1:4222",
                        state_dir=str(tmp_path))
    assert run_up(options) == 2
    err = capsys.readouterr().err
    assert "no user or password in the NATS URL" in err and "hunter2" not in err
