"""Adding and removing a worker through the orchestrator's local-process launcher: the
added worker registers and takes traffic; a command past the budget, or one that would
leave no decode worker, is refused with a reason; the removed worker drains, leaves and
its process is gone.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest

from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas import WorkerRole
from shared.schemas.orchestrator import AddWorker, ListWorkers, RemoveWorker
from shared.tokenizer import Tokenizer
from tests.e2e.control_plane_helpers import command
from tests.stack_fixtures import make_stack, request_records, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def launcher_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[LocalStack]:
    log_dir = tmp_path_factory.mktemp("add-remove")
    stack = make_stack(nats_server, tiny_model_dir, log_dir, workers=1)
    settings = {"launcher": "local", "worker_model_dir": tiny_model_dir, "worker_log_dir": str(log_dir),
                "max_workers": 2}
    stack.config = msgspec.structs.replace(stack.config, orchestrator_settings=settings)
    with running(stack) as local:
        yield local


async def test_add_and_remove_a_worker_through_the_launcher(launcher_stack: LocalStack, tiny_model_dir: str,
                                                            openai_client) -> None:
    stack = launcher_stack
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=30)
    async with request_records(stack, "add-remove-test") as records:
        added = await command(stack, AddWorker(role=WorkerRole.DECODE, worker_id="added-1"), timeout_s=60)
        assert added.ok, added
        [summary] = added.workers
        assert summary.launched and summary.registration.role is WorkerRole.DECODE
        pid = summary.registration.pid
        assert pid_alive(pid)

        table = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "cli.main", "ctl", "workers", "--nats-url", stack.nats_url,
            "--namespace", stack.config.namespace], capture_output=True, text=True, timeout=30)
        assert table.returncode == 0 and "added-1" in table.stdout and "yes" in table.stdout, table

        over_budget = await command(stack, AddWorker(role=WorkerRole.DECODE))
        assert over_budget.outcome == "refused" and "budget of 2" in over_budget.reason, over_budget

        # The router spreads distinct prompts over both workers: the added one serves some.
        for seed in range(12):
            prompt = [3 + (seed * 53 + i * 7) % 500 for i in range(48)]
            await client.completions.create(model=tokenizer.model_name, prompt=prompt, max_tokens=2, temperature=0)
            if any(r.worker_id == "added-1" for r in records):
                break
        await wait_for(lambda: any(r.worker_id == "added-1" for r in records), 5,
                       lambda: f"a request served by the added worker: {[r.worker_id for r in records]}")

        removed = await command(stack, RemoveWorker(worker_id="added-1", deadline_s=10), timeout_s=40)
        assert removed.ok, removed
        await wait_for(lambda: not pid_alive(pid), 5, "the removed worker's process to be gone")
        listing = await command(stack, ListWorkers())
        assert [s.registration.worker_id for s in listing.workers] == ["w1"]

        last = await command(stack, RemoveWorker(worker_id="w1"))
        assert last.outcome == "refused" and "minimum is 1" in last.reason, last
        unknown = await command(stack, RemoveWorker(worker_id="nobody"))
        assert unknown.outcome == "refused" and "no registered worker" in unknown.reason
        print(f"\nadd: {added.reason}; remove: {removed.reason}; refused: {over_budget.reason!r}, {last.reason!r}")
