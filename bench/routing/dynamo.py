"""NVIDIA Dynamo 1.6.1 beside Tandem: its frontend and KV router in front of its mocker engines,
as a context manager the routing benchmark drives with the same seeded requests.

    with DynamoStack(model_dir, workers=4, kv_blocks=300, router_mode="kv") as stack:
        ... stream to f"{stack.base_url}/v1/completions" with model=stack.model ...
        before = stack.counters(); ...; used = stack.counters() - before

What runs (all on loopback, every port picked free, nothing shared with another stack):
nats-server with JetStream (Dynamo's event plane: KV events, load metrics) in a temp store,
one `python -m dynamo.mocker --num-workers N` process (N engines on one tokio runtime),
and `python -m dynamo.frontend` (OpenAI HTTP, tokenizer, router). Discovery is Dynamo's
file backend in a private temp dir, requests travel over TCP. Each child leads its own
session and dies with its parent; its output goes to `<log_dir>/<name>.log` (without a
log_dir, inside the temp dir: the error of a failed start quotes the log tails). Leaving the
block (normally, on an error, on KeyboardInterrupt) stops the frontend, the mocker and NATS
(SIGTERM, then SIGKILL of the whole process group past a bounded wait) and removes the
temp dirs. The Dynamo venv (installed as `../shared/DESIGN.md` section 10 says) is
`venv=`, else `$TANDEM_DYNAMO_VENV`; a missing one is a `DynamoUnavailable` naming it.

Readiness (asked of Dynamo itself, never read from a log): all N `generate` instances of
the mocker are registered in the discovery store, the frontend lists the model at
`/v1/models` (it waits for N workers first: `--router-min-initial-workers N`), and a probe
completion streams back. The probe's prompt is shorter than a block, so it caches nothing.

Client: `dynamo_client(base_url)` (no keep-alive; see it for the 40 ms Nagle floor).

Prompts: Dynamo's `/v1/completions` takes token-id prompts (`"prompt": [1, 2, 3]`) as they
are: no detokenize/retokenize round trip (`usage.prompt_tokens` is the list's length, and
the KV router matches the ids' blocks), with `temperature 0, ignore_eos true, stream true,
stream_options.include_usage` as the routing bench sends them. So no text conversion is
needed. The mocker's output tokens are random ids, not a function of the prompt (unlike
Tandem's sim, whose answer `workloads.answer_tokens` predicts); Dynamo returns them with
`"nvext": {"extra_fields": ["completion_token_ids"]}` (`dynamo_drive.stream_answer`). The
mocker caches a request's prompt blocks only, not its answer's: a next turn that carries
the served answer hits the previous prompt's blocks, never the answer's (measured).

Counters: `stack.counters()` and `stack.router_counters()`, read from the frontend's
Prometheus `/metrics` (`dynamo_counters` says what each counts).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote

import httpx

from bench.routing.dynamo_counters import DynamoCounters, parse_counters, parse_router_counters
from bench.routing.dynamo_timing import write_profile_npz
from launch.process import ManagedProcess, start_or_undo
from launch.readiness import free_port
from services.worker.sim.profile import TimingProfile
from shared.lifecycle import die_with_parent
from shared.nats_server import EmbeddedNats

VENV_ENV = "TANDEM_DYNAMO_VENV"
ROUTER_MODES = ("kv", "round-robin", "random")
HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
PORT_ATTEMPTS = 3
DEFAULT_MAX_CONTEXT = 8192  # the timing profile's context range when max_model_len is not set


def dynamo_client(base_url: str, timeout_s: float = 300.0) -> httpx.AsyncClient:
    """The routing bench's HTTP client for a Dynamo frontend: a new connection per request.

    Dynamo 1.6.1's HTTP server leaves Nagle's algorithm on: on a kept-alive connection the
    first SSE chunk after the response headers waits for the client's delayed ACK, a floor of
    ~40 ms under every TTFT (measured: 44-48 ms for a 20 ms answer; a fresh connection is in
    quick-ACK mode and sees 20 ms). Tandem's router (asyncio sets TCP_NODELAY) has no floor,
    so keeping the connection alive would compare HTTP stacks, not routers. A loopback
    connect costs ~0.1 ms."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


class DynamoUnavailable(RuntimeError):
    """The Dynamo venv is missing or incomplete."""


def dynamo_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The Dynamo venv's interpreter (`venv`, else `$TANDEM_DYNAMO_VENV`), checked to carry
    `dynamo.mocker` and `dynamo.frontend`; `DynamoUnavailable` says what is missing."""
    root = venv or os.environ.get(VENV_ENV)
    if not root:
        raise DynamoUnavailable(f"no Dynamo venv: pass venv= or set {VENV_ENV} (DESIGN.md section 10 installs one)")
    python = Path(root) / "bin" / "python"
    if not python.exists():
        raise DynamoUnavailable(f"no Dynamo venv at {root}: {python} does not exist")
    packages = list((Path(root) / "lib").glob("python3*/site-packages/dynamo"))
    if not packages or not all((packages[0] / name).is_dir() for name in ("mocker", "frontend")):
        raise DynamoUnavailable(f"the venv at {root} has no dynamo.mocker/dynamo.frontend: "
                                "pip install --no-deps ai-dynamo==1.6.1 (DESIGN.md section 10)")
    return python


class DynamoStack:
    """A Dynamo frontend + router + N mocker workers; see the module docstring.

    `kv_blocks` is each worker's KV pool (`--num-gpu-blocks-override`); `speedup_ratio`
    divides the mocker's simulated pass times; `timing_profile` (a sim `TimingProfile`)
    replaces the mocker's stock timing with the sim's (`dynamo_timing`; its
    `mocker_settings(shape)` gives all the engine arguments of a bench run); `max_num_seqs`,
    `max_num_batched_tokens` and `max_model_len` go to the mocker when given (its defaults:
    256, 8192, unlimited); `extra_mocker_args`/`extra_frontend_args` are appended verbatim.
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, workers: int = 2, block_size: int = 16,
                 kv_blocks: int = 512, speedup_ratio: float = 1000.0, decode_speedup_ratio: float = 1.0,
                 router_mode: str = "kv", max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 log_dir: str | os.PathLike[str] | None = None, venv: str | os.PathLike[str] | None = None,
                 timing_profile: TimingProfile | None = None, extra_mocker_args: tuple[str, ...] = (),
                 extra_frontend_args: tuple[str, ...] = (), start_timeout_s: float = START_TIMEOUT_S) -> None:
        if router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {', '.join(ROUTER_MODES)}, not {router_mode!r}")
        if workers < 1 or block_size < 1 or kv_blocks < 1:
            raise ValueError("workers, block_size and kv_blocks must be >= 1")
        if speedup_ratio <= 0 or decode_speedup_ratio <= 0:
            raise ValueError("speedup ratios must be > 0 (the mocker's 0 does not remove its delays)")
        self.python = dynamo_python(venv)
        self.model_dir = str(Path(model_dir).resolve())
        if not (Path(self.model_dir) / "tokenizer.json").exists():
            raise FileNotFoundError(f"{self.model_dir} has no tokenizer.json (shared.tiny_model.ensure_tiny_model)")
        self.workers, self.block_size, self.kv_blocks = workers, block_size, kv_blocks
        self.speedup_ratio, self.decode_speedup_ratio = speedup_ratio, decode_speedup_ratio
        self.router_mode = router_mode
        self.timing_profile = timing_profile
        self.engine_limits = {"--max-num-seqs": max_num_seqs, "--max-num-batched-tokens": max_num_batched_tokens,
                              "--max-model-len": max_model_len}
        self.extra_mocker_args, self.extra_frontend_args = tuple(extra_mocker_args), tuple(extra_frontend_args)
        self.start_timeout_s = start_timeout_s
        self._log_dir_arg = Path(log_dir) if log_dir is not None else None
        self.log_dir: Path | None = None  # given, or inside the stack's temp dir (removed at exit)
        self.model = self.model_dir  # the frontend serves the model under its path
        self.base_url = ""
        self.nats: EmbeddedNats | None = None
        self.processes: dict[str, ManagedProcess] = {}
        self._state_dir: Path | None = None
        self._profile_path: Path | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> DynamoStack:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def start(self) -> DynamoStack:
        start_or_undo(self._start, self.stop)
        return self

    def _start(self) -> None:
        self._state_dir = Path(tempfile.mkdtemp(prefix="tandem-dynamo-"))
        self.log_dir = self._log_dir_arg or self._state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.timing_profile is not None:
            self._profile_path = write_profile_npz(
                self.timing_profile, self._state_dir / "timing.npz", block_size=self.block_size,
                max_context=self.engine_limits["--max-model-len"] or DEFAULT_MAX_CONTEXT,
                max_kv_tokens=self.kv_blocks * self.block_size)
        self.nats = EmbeddedNats(str(self._state_dir / "nats")).start()
        env = self._env()
        # no DYN_SYSTEM_PORT: the mocker's own /metrics shows one engine of N only (and the
        # runtime takes the port as an i16)
        self._spawn("mocker", ["-m", "dynamo.mocker", *self.mocker_args()], env)
        deadline = time.monotonic() + self.start_timeout_s
        self._wait(lambda: self._registered_instances() >= self.workers, deadline,
                   f"{self.workers} mocker workers registered")
        for attempt in range(PORT_ATTEMPTS):
            port = free_port(HOST)
            self.base_url = f"http://{HOST}:{port}"
            frontend = self._spawn("frontend", ["-m", "dynamo.frontend", *self.frontend_args(port)], env)
            try:
                with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
                    self._wait(lambda: self._serves_model(client), deadline,
                               f"{self.base_url}/v1/models lists the model")
                    self._wait(lambda: self._probe(client), deadline, "a probe completion")
                return
            except RuntimeError:
                # another process took the free port between the probe and the frontend's bind
                if frontend.alive or "already in use" not in frontend.log_tail() or attempt + 1 == PORT_ATTEMPTS:
                    raise
                del self.processes["frontend"]

    def stop(self) -> None:
        """Frontend, then mocker, then NATS; each SIGTERM then, past a bounded wait, SIGKILL of
        its process group. Safe to call twice."""
        for name in ("frontend", "mocker"):
            process = self.processes.pop(name, None)
            if process is None:
                continue
            if process.alive:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            process.wait_or_kill(STOP_TIMEOUT_S)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None

    # ---- what runs --------------------------------------------------------------------------

    def mocker_args(self) -> list[str]:
        args = ["--model-path", self.model_dir, "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.kv_blocks), "--speedup-ratio", f"{self.speedup_ratio:g}",
                "--decode-speedup-ratio", f"{self.decode_speedup_ratio:g}", "--disaggregation-mode", "agg",
                "--num-workers", str(self.workers)]
        for flag, value in self.engine_limits.items():
            if value is not None:
                args += [flag, str(value)]
        if self._profile_path is not None:
            args += ["--planner-profile-data", str(self._profile_path)]
        return args + list(self.extra_mocker_args)

    def frontend_args(self, port: int) -> list[str]:
        return ["--http-host", HOST, "--http-port", str(port), "--router-mode", self.router_mode,
                "--kv-cache-block-size", str(self.block_size), "--router-min-initial-workers", str(self.workers),
                *self.extra_frontend_args]

    def _env(self) -> dict[str, str]:
        assert self.nats is not None and self._state_dir is not None
        return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self._state_dir / "discovery"),
                "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "nats", "NATS_SERVER": self.nats.url,
                "DYN_TCP_RPC_HOST": HOST, "DYN_TCP_RESPONSE_STREAM_HOST": HOST, "DYN_EVENT_PLANE_HOST": HOST,
                "DYN_SYSTEM_HOST": HOST}

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> ManagedProcess:
        assert self.log_dir is not None
        argv = [str(self.python), *args]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     env=env, cwd=self._state_dir, start_new_session=True,
                                     preexec_fn=die_with_parent)
        process = ManagedProcess(name, argv, popen, log_path)
        self.processes[name] = process
        return process

    # ---- readiness ----------------------------------------------------------------------------

    def _wait(self, condition, deadline: float, what: str) -> None:
        while True:
            for process in self.processes.values():
                if not process.alive:
                    raise RuntimeError(f"dynamo {process.name} exited with {process.popen.returncode} "
                                       f"before {what}:\n{process.log_tail()}")
            if condition():
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name} ({p.log_path})\n{p.log_tail()}" for p in self.processes.values())
                raise TimeoutError(f"dynamo: no {what} within {self.start_timeout_s:g}s\n{tails}")
            time.sleep(POLL_S)

    def _registered_instances(self) -> int:
        """`generate` endpoint instances in the file discovery store (one per mocker worker)."""
        assert self._state_dir is not None
        instances = self._state_dir / "discovery" / "v1" / "instances"
        try:
            names = [unquote(entry.name) for entry in instances.iterdir()]
        except OSError:
            return 0
        return sum(1 for name in names if name.split("/")[2:3] == ["generate"])

    def _serves_model(self, client: httpx.Client) -> bool:
        try:
            response = client.get("/v1/models")
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and any(model.get("id") == self.model
                                                   for model in response.json().get("data", []))

    def _probe(self, client: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": [3] * max(1, self.block_size - 1), "max_tokens": 1,
                "temperature": 0, "ignore_eos": True}
        try:
            response = client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1

    # ---- figures ------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.base_url}/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text

    def counters(self) -> DynamoCounters:
        return parse_counters(self.metrics_text())

    def router_counters(self) -> dict[str, int]:
        return parse_router_counters(self.metrics_text())

    @property
    def pids(self) -> list[int]:
        """Every process this stack started and still holds (for CPU accounting, or checks)."""
        pids = [process.pid for process in self.processes.values()]
        if self.nats is not None and self.nats.process is not None:
            pids.append(self.nats.process.pid)
        return pids
