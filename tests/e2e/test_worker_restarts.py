"""`tandem up`'s worker supervisor on a running sim stack: a worker process that dies is
started again after its backoff and registers how often and why; past the policy's
limit the supervisor gives up and says why; a worker that exits normally stays down."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest

from launch.restart_policy import RestartPolicy
from launch.stack import LocalStack
from launch.supervisor import WorkerSupervisor
from shared.bus import connect
from shared.nats_server import EmbeddedNats
from shared.schemas import MembershipChange
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.test_tandem_status import tandem_status
from tests.stack_fixtures import collect, make_stack, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

POLICY = RestartPolicy(max_restarts=2, window_s=300.0, first_backoff_s=0.2, max_backoff_s=0.4)


@pytest.fixture
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[LocalStack]:
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("restarts"), workers=2)) as local:
        yield local


async def test_a_dead_worker_is_started_again_until_the_policy_gives_up(stack: LocalStack, tiny_model_dir: str,
                                                                       openai_client) -> None:
    said: list[str] = []
    supervisor = WorkerSupervisor(stack, said.append, POLICY)
    bus = await connect(stack.nats_url, "restarts-test")
    changes: list[MembershipChange] = await collect(bus, MembershipChange,
                                                    Subjects(stack.config.namespace).membership_changes)

    def joined(restarts: int) -> list[MembershipChange]:
        # "updated" where the new process registered before the old one's key expired
        return [c for c in changes if c.kind in ("joined", "updated") and c.worker_id == "w1"
                and c.registration is not None and c.registration.restarts == restarts]

    async def kill_and_tick(until, what: str) -> None:
        stack.worker("w1").popen.send_signal(signal.SIGKILL)
        async def ticked() -> bool:
            supervisor.tick()
            return bool(until())
        await wait_for(ticked, 30, what)

    try:
        for restart in (1, 2):
            await kill_and_tick(lambda restart=restart: joined(restart), f"w1's registration after restart {restart}")
            assert {c.registration.last_exit for c in joined(restart)} == {"killed by SIGKILL"}, changes
        # the collector's view, `tandem status` and so the cluster page say it
        await wait_for(lambda: _restarts_shown(stack) == (2, "killed by SIGKILL"), 10, "the restarts in /cluster")
        table = tandem_status("--metrics-url", stack.metrics_url)
        assert table.returncode == 0 and "2 (last: killed by SIGKILL)" in " ".join(table.stdout.split()), table.stdout
        reply = await openai_client(stack.router_url).completions.create(
            model=Tokenizer.from_model_dir(tiny_model_dir).model_name, prompt="restarted", max_tokens=4)
        assert reply.usage.completion_tokens == 4
        await kill_and_tick(lambda: "w1" in supervisor.given_up, "the supervisor to give up on w1")
        assert "w1 exited 3 times within 300 s (last: killed by SIGKILL)" in supervisor.given_up["w1"]
        assert [line.split(";")[0] for line in said if "w1" in line][-1].startswith("giving up on worker w1"), said
        assert sum("started again" in line for line in said) == 2, said
        await asyncio.sleep(1.0)  # a few more ticks: nothing starts it again
        for _ in range(5):
            supervisor.tick()
        assert not stack.worker("w1").alive

        stack.worker("w2").popen.send_signal(signal.SIGTERM)  # a normal stop: exit 0
        await wait_for(lambda: not stack.worker("w2").alive, 30, "w2 to stop")
        supervisor.tick()
        assert stack.worker("w2").popen.returncode == 0 and "w2" in supervisor.given_up
        assert "worker w2 exited normally; not restarting it" in said, said
    finally:
        await bus.close()


def _restarts_shown(stack: LocalStack) -> tuple[int, str] | None:
    workers = httpx.get(f"{stack.metrics_url}/cluster", timeout=5).json()["workers"]
    return next(((w["restarts"], w["last_exit"]) for w in workers if w["worker_id"] == "w1"), None)
