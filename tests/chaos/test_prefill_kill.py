"""A prefill worker SIGKILLed while decode workers are pulling prompts it holds.

A whole stack of real processes: two prefill and two decode sim workers, every request
disaggregated. The decode workers start each pull 1 s late (injected transfer delay), so
the prefill workers hold leased blocks while the reads are under way. Once p1 holds
leases, it is killed with SIGKILL, and new requests keep arriving at once.

What the design promises, and what is checked:
- every request in flight at the kill ends within a bound: either with exactly the
  undisturbed answer (a decode worker whose pull failed recomputes the prompt; a request
  still prefilling on p1 is retried on p2) or with an explicit error; none hangs;
- the pulls from p1 that were under way end in an explicit "failed" outcome with the
  missing tokens recomputed;
- new requests, sent right after the kill and after the router has seen p1 go, all
  succeed, disaggregated, on p2;
- afterwards no decode worker (nor p2) holds a lease, a used KV block or a request.
"""

from __future__ import annotations

import signal
import time

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.chaos import streams
from tests.stack_fixtures import observing
from tests.waiting import wait_for

IN_FLIGHT = 40  # streams open at the kill
NEW = 20  # streams sent right after the kill, and again once p1 is gone
MAX_TOKENS = 16
TTL_S = 1.5
PULL_DELAY_S = 1.0
END_BOUND_S = 20.0  # every stream has ended this long after it was sent (or after the kill)
DECODE_ARGS = ("--kv-fault-delay", str(PULL_DELAY_S))

SPECS = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL), WorkerSpec(worker_id="p2", role=WorkerRole.PREFILL),
         WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=DECODE_ARGS),
         WorkerSpec(worker_id="d2", role=WorkerRole.DECODE, extra_args=DECODE_ARGS))


stack = streams.worker_loss_stack(SPECS, ttl_s=TTL_S)


async def test_prefill_worker_killed_mid_transfer(stack: LocalStack, tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    prompts = streams.token_prompts(tokenizer, IN_FLIGHT + 2 * NEW, seed=3)
    expected = await streams.expected_texts(tokenizer, prompts, MAX_TOKENS)
    first, after_kill, after_leave = prompts[:IN_FLIGHT], prompts[IN_FLIGHT:-NEW], prompts[-NEW:]
    client = openai_client(stack.router_url, timeout=60)
    model = tokenizer.model_name
    async with observing(stack, ("p1", "p2", "d1", "d2"), "chaos-observer") as observer:
        tasks, outcomes = streams.start_streams(client, model, first, MAX_TOKENS)
        await wait_for(lambda: observer.leases("p1") >= 2, 20,
                       lambda: f"p1 to hold leases for delayed pulls: {observer.loads.latest}")
        stack.worker("p1").popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        new_tasks, new_outcomes = streams.start_streams(client, model, after_kill, MAX_TOKENS)

        await streams.all_ended(tasks + new_tasks, outcomes + new_outcomes, killed_at + END_BOUND_S,
                        f"{END_BOUND_S}s after the kill")
        completed, errors = streams.check_outcomes(outcomes, expected[:IN_FLIGHT])
        new_completed, new_errors = streams.check_outcomes(new_outcomes, expected[IN_FLIGHT:-NEW])
        ended_s = max(outcome.ended_at or killed_at for outcome in outcomes + new_outcomes) - killed_at
        failed_pulls = [record for record in observer.records
                        if record.peer_worker_id == "p1" and record.outcome == "failed"]
        print(f"\nin flight at the kill: {completed} completed, {errors} explicit errors; sent after: "
              f"{new_completed} completed, {new_errors} errors; {len(failed_pulls)} pulls from p1 failed; "
              f"last stream ended {ended_s:.2f}s after the kill")
        assert new_errors == 0, [o.error for o in new_outcomes if o.error]
        assert failed_pulls, "no pull from p1 was under way at the kill"
        # what did not arrive was computed by the decode workers (and the answers above are right)
        assert all(record.blocks_ok < record.blocks and record.recomputed_tokens > 0 for record in failed_pulls)

        # once the router has seen p1 go, new requests are served disaggregated on p2
        await wait_for(lambda: _without(stack.router_url, "p1"), 2 * TTL_S + 5, "the router to drop p1")
        disaggregated = await streams.router_metric(stack.router_url, "tandem_router_disaggregated_requests_total")
        prefilled = await observer.settled("p2", "prompt_tokens_total")
        later_tasks, later_outcomes = streams.start_streams(client, model, after_leave, MAX_TOKENS)
        await streams.all_ended(later_tasks, later_outcomes, time.monotonic() + END_BOUND_S, "after p1 left")
        later_completed, _ = streams.check_outcomes(later_outcomes, expected[-NEW:])
        assert later_completed == NEW
        assert await streams.router_metric(stack.router_url, "tandem_router_disaggregated_requests_total") \
            == disaggregated + NEW
        assert await observer.settled("p2", "prompt_tokens_total") - prefilled == sum(map(len, after_leave))

        # nothing leaked on the survivors, nothing left in flight at the router
        observer.workers = ("p2", "d1", "d2")
        await observer.assert_clean(timeout_s=20)
        await streams.wait_router_idle(stack.router_url)


async def _without(router_url: str, worker_id: str) -> bool:
    return worker_id not in await streams.router_members(router_url)
