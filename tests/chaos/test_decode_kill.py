"""A decode worker SIGKILLed while 200 streams are mid-generation.

A whole stack of real processes (nats-server, orchestrator, metrics collector, router, one
prefill and two decode sim workers; every request disaggregated) serves 200 concurrent
greedy streamed completions through the official `openai` client, twice: undisturbed (the
reference answers, and how long the stack takes on this machine now), then again with d1
killed by SIGKILL once both decode workers are generating. The router hears d1 leave
(membership TTL) and resumes each of its streams on a new prefill/decode pair for the prompt
plus the tokens already sent. Every stream must end within a bound (the TTL plus twice the
undisturbed run: at most the whole work again, on a machine whose speed varies), either
with exactly the undisturbed text or with an explicit error; streams were actually
migrated; and afterwards the survivors hold no lease, no used KV block and no request, and
the router has nothing in flight.
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

STREAMS = 200
MAX_TOKENS = 64
TTL_S = 1.5
SLACK_S = 10.0
DECODE_ARGS = ("--max-num-seqs", "128")  # 200 streams run at once on two decode workers

SPECS = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL),
         WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=DECODE_ARGS),
         WorkerSpec(worker_id="d2", role=WorkerRole.DECODE, extra_args=DECODE_ARGS))


stack = streams.worker_loss_stack(SPECS, ttl_s=TTL_S)


async def test_decode_worker_killed_mid_stream(stack: LocalStack, tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    prompts = streams.token_prompts(tokenizer, STREAMS)
    client = openai_client(stack.router_url, timeout=120)
    async with observing(stack, ("p1", "d1", "d2"), "chaos-observer") as observer:
        started = time.monotonic()
        tasks, undisturbed = streams.start_streams(client, tokenizer.model_name, prompts, MAX_TOKENS)
        await streams.all_ended(tasks, undisturbed, started + 90, "in the undisturbed run")
        undisturbed_s = time.monotonic() - started
        assert all(outcome.completed and outcome.finish_reason == "length" for outcome in undisturbed), \
            [outcome.error for outcome in undisturbed if not outcome.completed][:3]
        expected = ["".join(outcome.text) for outcome in undisturbed]
        await observer.assert_clean()

        tasks, outcomes = streams.start_streams(client, tokenizer.model_name, prompts, MAX_TOKENS)

        def both_decoding() -> bool:
            loads = observer.loads.latest
            started = sum(outcome.chunks >= 2 for outcome in outcomes)
            return loads["d1"].running >= 20 and loads["d2"].running >= 20 and started >= STREAMS // 4

        await wait_for(both_decoding, 60, lambda: f"both decode workers generating: {observer.loads.latest}, "
                                                  f"{sum(o.chunks >= 2 for o in outcomes)} streams under way")
        stack.worker("d1").popen.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        bound_s = TTL_S + 2 * undisturbed_s + SLACK_S
        await streams.all_ended(tasks, outcomes, killed_at + bound_s, f"{bound_s:.1f}s after the kill")
        ended_s = max(outcome.ended_at or killed_at for outcome in outcomes) - killed_at

        completed, errors = streams.check_outcomes(outcomes, expected)
        resumed = await streams.router_metric(stack.router_url, "tandem_router_resumes_total", result="resumed",
                                      stage="mid_stream")
        print(f"\n{completed} completed, {errors} explicit errors, {resumed:.0f} resumed mid-stream; last stream ended "
              f"{ended_s:.2f}s after the kill (undisturbed run: {undisturbed_s:.2f}s)")
        # the kill landed mid-stream: d1 was generating for at least 20 of them
        assert resumed >= 20, f"only {resumed:.0f} streams were migrated mid-stream"
        assert completed + errors == STREAMS

        # nothing leaked on the survivors, nothing left in flight at the router
        observer.workers = ("p1", "d2")
        await observer.assert_clean(timeout_s=20)
        await streams.wait_router_idle(stack.router_url)
        assert "d1" not in await streams.router_members(stack.router_url)
