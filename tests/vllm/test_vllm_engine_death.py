"""A vLLM engine that dies under its worker, and the host's attention kernel.

A 1P1D stack of real vLLM (CPU) engines, watched by `tandem up`'s worker supervisor, with
the decode worker at tensor-parallel degree 1 and again at 2. While 16 streams run, the
decode worker's vLLM model-worker process (not the Tandem worker; at TP 2, one of its
ranks) is SIGKILLed: every stream completes or ends with an explicit error, none
hangs; the worker leaves the routing pool within a second and exits non-zero; the
supervisor starts it again and it serves within its own start time (the restarted
process's) plus 10 s; no KV block or lease is left behind.

The kernel test holds on every host: where the CPU has AMX, each vLLM process asked for AMX
tile state and vLLM runs its AMX attention kernel (bfloat16) on short and long prompts;
elsewhere it runs another kernel and says there is no AMX.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator

import openai
import psutil
import pytest
from nats.aio.msg import Msg

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from connector.vllm.amx import cpu_has_amx  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from launch.supervisor import WorkerSupervisor  # noqa: E402
from services.worker.engine import ENGINE_FAILED_EXIT  # noqa: E402
from shared.bus import connect  # noqa: E402
from shared.codec import Codec  # noqa: E402
from shared.schemas import LoadSnapshot, MembershipChange  # noqa: E402
from shared.schemas.orchestrator import ListWorkers  # noqa: E402
from shared.subjects import Subjects  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.control_plane_helpers import command  # noqa: E402
from tests.stack_fixtures import collect  # noqa: E402
from tests.vllm.conftest import pd_pair  # noqa: E402
from tests.vllm.observer import LONG_LEASES, Observer, complete, observing  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # the TP 2 stack starts in 1-3 minutes on a busy 2-core host

STREAMS = 16
STREAM_TOKENS = 1500  # long enough to be cut: the kill comes with most of them still to make


# The decode worker at tensor-parallel degree 1, and at 2 (two model-worker ranks, one per
# core here: one of them is killed, and the engine dies the same way).
DECODE_SHAPES = {"tp1": (), "tp2": ("--tensor-parallel", "2", "--vllm-cpu-threads-bind", "0|1")}


@pytest.fixture(scope="module", params=["tp1", "tp2"])
def stack(request: pytest.FixtureRequest, nats_server, tiny_model_dir: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from pd_pair(nats_server, tiny_model_dir, tmp_path_factory.mktemp(f"vllm-engine-death-{request.param}"),
                       DECODE_SHAPES[request.param])


@pytest.fixture(scope="module")
async def observer(stack: LocalStack) -> AsyncIterator[Observer]:
    async with observing(stack) as watcher:
        yield watcher


async def _stream(client: openai.AsyncOpenAI, model: str, index: int) -> str:
    """One long streamed completion: its finish reason, or "error <kind>" for an explicit error."""
    prompt = [7 + (index * 31 + i * 3) % 450 for i in range(150 + index * 5)]
    try:
        chunks = await client.completions.create(model=model, prompt=prompt, stream=True, max_tokens=STREAM_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                return chunk.choices[0].finish_reason
            # A chunk already read is no await: without this, a client far behind the engine
            # runs through its buffer and the 16 of them starve the test's watch of the engine
            # (on CI it saw one report at 10% of the tokens, the next after the last one).
            await asyncio.sleep(0)
        return "ended without a finish reason"  # a stream cut short silently: the test fails on it
    except openai.APIError as error:  # an explicit error: what a failed request must give
        return f"error {type(error).__name__}"


@contextlib.asynccontextmanager
async def _supervising(supervisor: WorkerSupervisor) -> AsyncIterator[None]:
    """`tandem up`'s loop, ticking the supervisor while the block runs. On the test's own loop,
    not in a thread: a worker's parent-death signal follows the thread that started it."""
    async def supervise() -> None:
        while True:
            supervisor.tick()
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(supervise())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


class _DecodeProgress:
    """The decode worker's load reports since the streams began, as (running, waiting,
    tokens made): when to kill, and what the test saw if that moment never came."""

    def __init__(self, generated_before: int) -> None:
        self.generated_before = generated_before
        self.seen: list[tuple[int, int, int]] = []  # (running, waiting, made)

    def mid_stream(self, load: LoadSnapshot) -> bool:
        """Streams decoding there with most of their tokens still to come. Half the streams
        decoding at once is the moment sought; once a quarter of all tokens are made without
        it (a slow host's prefills trail its decodes, so the first streams end before the
        last ones arrive), any stream decoding will do."""
        made = load.generated_tokens_total - self.generated_before
        self.seen.append((load.running, load.waiting, made))
        all_tokens = STREAMS * STREAM_TOKENS
        enough_running = STREAMS // 2 if made < all_tokens // 4 else 1
        return load.running >= enough_running and 0 < made <= all_tokens * 9 // 10

    def __str__(self) -> str:
        most_running = max((seen[0] for seen in self.seen), default=0)
        return (f"the decode worker's reports (running, waiting, made), at most {most_running} running: "
                f"{self.seen[:40]} ... {self.seen[-10:]}")


class _MidStreamKiller:
    """SIGKILLs `victim` at the decode worker's first mid-stream load report, and times its
    worker's leaving the cluster and the restarted worker's joining. It reads the bus on its own connection in a thread of its
    own: on CI the test's loop, busy with 16 stream clients, looked at the reports too
    seldom, and the engine went from 19% to 79% of the tokens between two of its looks."""

    def __init__(self, stack: LocalStack, progress: _DecodeProgress, victim: psutil.Process) -> None:
        self.stack, self.progress, self.victim = stack, progress, victim
        self.killed_at = 0.0  # time.monotonic(), one clock for every thread
        self.killed_during: tuple[int, int, int] | None = None
        self.left_s: float | None = None  # from the kill to d1's first removal
        self.joined_s: float | None = None  # from the kill to the restarted d1's registration

    async def kill_mid_stream(self, timeout_s: float, restart_s: float) -> None:
        """Kill within `timeout_s`; return once the restarted worker joined (within `restart_s`)."""
        await asyncio.to_thread(asyncio.run, self._watch(timeout_s, restart_s))
        assert self.killed_during is not None, f"no report mid-stream within {timeout_s} s: {self.progress}"
        assert self.left_s is not None, "the decode worker did not leave the cluster within 30 s"
        assert self.joined_s is not None, f"the restarted worker did not register within {restart_s:.0f} s"

    async def _watch(self, timeout_s: float, restart_s: float) -> None:
        loads: Codec[LoadSnapshot] = Codec(LoadSnapshot)
        changes: Codec[MembershipChange] = Codec(MembershipChange)
        killed, left, joined = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def on_load(msg: Msg) -> None:
            load = loads.decode_or_none(msg.data, msg.subject)
            if load is not None and not killed.is_set() and self.progress.mid_stream(load):
                self.victim.kill()
                self.killed_at, self.killed_during = time.monotonic(), self.progress.seen[-1]
                killed.set()

        async def on_change(msg: Msg) -> None:
            change = changes.decode_or_none(msg.data, msg.subject)
            if not killed.is_set() or change is None or change.worker_id != "d1":
                return
            if change.kind == "removed" and not left.is_set():
                self.left_s = time.monotonic() - self.killed_at
                left.set()
            restarted = change.registration is not None and change.registration.restarts == 1
            if change.kind == "joined" and restarted and not joined.is_set():
                self.joined_s = time.monotonic() - self.killed_at
                joined.set()

        subjects = Subjects(self.stack.config.namespace)
        bus = await connect(self.stack.nats_url, "engine-death-killer")
        try:
            await bus.client.subscribe(subjects.load("d1"), cb=on_load)
            await bus.client.subscribe(subjects.membership_changes, cb=on_change)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(killed.wait(), timeout_s)
                await asyncio.wait_for(left.wait(), 30)
                await asyncio.wait_for(joined.wait(), restart_s)
        finally:
            await bus.close()


def _model_worker(worker_pid: int) -> psutil.Process:
    """The vLLM process that runs the model for the Tandem worker `worker_pid` (its
    deepest "VLLM" descendant: the engine core's own child)."""
    engine = [p for p in psutil.Process(worker_pid).children(recursive=True) if p.name().startswith("VLLM")]
    assert engine, "the worker has no vLLM processes"
    return max(engine, key=lambda process: len(process.parents()))


async def test_each_host_runs_its_attention_kernel_with_amx_state_where_the_cpu_has_it(
        stack: LocalStack, openai_client, tiny_model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=120)
    for length in (3, 17, 300):  # the short ones are those that died on AMX hosts
        prompt = [5 + (i * 13) % 400 for i in range(length)]
        assert await complete(client, tokenizer.model_name, prompt, 8)
    for worker_id in ("p1", "d1"):
        log = stack.worker(worker_id).log_path.read_text(errors="replace")
        [kernel] = re.findall(r"attention kernel (\w+)", log)
        if cpu_has_amx():
            assert kernel == "amx", log[-3000:]
            granted = re.findall(r"AMX tile state granted to pid (\d+)", log)
            # the engine core and its model worker, each before any model code ran
            assert len(set(granted)) >= 2, log[-3000:]
            assert "refused AMX tile state" not in log
        else:  # said by the worker and by each of vLLM's processes
            assert kernel != "amx" and len(set(re.findall(r"no AMX on this CPU \(pid (\d+)", log))) >= 3, log[-3000:]
        assert stack.worker(worker_id).alive


async def test_a_killed_model_worker_takes_its_worker_out_and_the_supervisor_brings_it_back(
        stack: LocalStack, observer: Observer, openai_client, tiny_model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=120)
    decode = stack.worker("d1")
    first_start_s = await _start_seconds(stack, "d1")
    said: list[str] = []
    supervisor = WorkerSupervisor(stack, said.append)
    bus = await connect(stack.nats_url, "engine-death-test")
    changes: list[MembershipChange] = await collect(bus, MembershipChange,
                                                    Subjects(stack.config.namespace).membership_changes)
    try:
        async with _supervising(supervisor):
            await observer.loads.fresh_reports(["d1"])
            generated_before = observer.counter("d1", "generated_tokens_total")
            streams = [asyncio.create_task(_stream(client, tokenizer.model_name, index))
                       for index in range(STREAMS)]
            # The kill comes while the engine has most of the streams' tokens still to make, by
            # its own reports (every 0.25 s): the client may read far behind the engine, and on
            # a slow host waiting for the client let the engine end every stream first. Not
            # every stream need be running at once: on a slow host the first may end before
            # the last one's KV has arrived.
            progress = _DecodeProgress(generated_before)
            before_kill = len(changes)  # a flap under load before the kill is not what is tested
            killer = _MidStreamKiller(stack, progress, _model_worker(decode.pid))
            await killer.kill_mid_stream(120, first_start_s + 30)
            killed_at, killed_during, left_s = killer.killed_at, killer.killed_during, killer.left_s
            assert not decode.alive and decode.popen.returncode == ENGINE_FAILED_EXIT, decode.log_tail()
            assert stack.worker("d1") is not decode and stack.worker("d1").alive
            prompt = [9 + i % 300 for i in range(40)]
            assert await complete(client, tokenizer.model_name, prompt, 8)
            back_s = time.monotonic() - killed_at
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 120)  # none hangs
            # "its start time": the restarted process's own, which a loaded host stretches
            # alike for both starts (measured: 41 s, then 54 s, with other tests running)
            restart_start_s = await _start_seconds(stack, "d1")
    finally:
        await bus.close()
    assert all(o in ("length", "stop") or o.startswith("error ") for o in outcomes), outcomes
    # Mid-stream by the engine's own report; the router may resume every cut stream
    # elsewhere, so the streams need not end in errors.
    assert killed_during[0] >= 1, f"the kill came after every stream had ended: {progress}"
    assert left_s <= 1.0, f"the dead engine's worker left the routing pool after {left_s:.2f} s"
    assert back_s <= restart_start_s + 10, (back_s, restart_start_s, first_start_s, said)
    since_kill = [c for c in changes[before_kill:] if c.worker_id == "d1" and c.registration is not None]
    # The dead process's changes end with its leaving (a heartbeat missed on a starved host may
    # make it flap first), and all come before the restarted process's, whose first is joining.
    old = [i for i, c in enumerate(since_kill) if c.registration.pid == decode.pid]
    new = [i for i, c in enumerate(since_kill) if c.registration.pid != decode.pid]
    assert old and new and old[-1] < new[0], _changes_seen(changes)
    assert since_kill[old[-1]].kind == "removed", _changes_seen(changes)
    joined = since_kill[new[0]]
    assert (joined.kind, joined.reason, joined.registration.restarts) == ("joined", "registered", 1), \
        _changes_seen(changes)
    assert "exit 3" in joined.registration.last_exit, joined
    # Later changes are the restarted worker's own (a heartbeat missed on a loaded host), never a second restart.
    assert all(since_kill[i].registration.restarts == 1 for i in new), _changes_seen(changes)
    assert any("started again (restart 1)" in line for line in said), said
    try:
        await observer.assert_clean(_clean_within_s(changes))
    except AssertionError as error:
        raise AssertionError(f"{error}\nthe restarted d1's log: {stack.worker('d1').log_tail(80)}") from None
    print(f"\nmodel worker killed at (running, waiting, made) {killed_during}: d1 out of the pool in {left_s:.2f} s, "
          f"registered again after {killer.joined_s:.1f} s, serving after {back_s:.1f} s "
          f"(first start {first_start_s:.1f} s, restart {restart_start_s:.1f} s); streams: "
          f"{sorted((o, outcomes.count(o)) for o in set(outcomes))}; {said}; d1's membership changes: "
          f"{[c for c in _changes_seen(changes) if c[1] == 'd1']}")


def _clean_within_s(changes: list[MembershipChange]) -> float:
    """How long the workers may take to be back to no used block and no lease. Released
    leases: 20 s. But when p1 dropped out of the membership (a heartbeat missed on a starved
    host) the router gave up its prompts in flight and resumed them elsewhere, while p1 went
    on and held their blocks for a decode worker that never asks: those holds end at their
    lease TTL (`LONG_LEASES` in this stack), not before."""
    p1_flapped = any(c.worker_id == "p1" and c.kind == "removed" for c in changes)
    return float(LONG_LEASES[1]) + 10 if p1_flapped else 20.0


def _changes_seen(changes: list[MembershipChange]) -> list[tuple]:
    return [(c.kind, c.worker_id, c.reason, c.registration and (c.registration.pid, c.registration.restarts,
                                                                  c.registration.status.value))
            for c in changes]


async def _start_seconds(stack: LocalStack, worker_id: str) -> float:
    """How long the worker took from its process's creation to serving (its registration's
    start, stamped once the engine is up)."""
    listing = await command(stack, ListWorkers())
    [registration] = [s.registration for s in listing.workers if s.registration.worker_id == worker_id]
    return registration.started_at - psutil.Process(stack.worker(worker_id).pid).create_time()
