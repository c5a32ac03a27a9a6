"""Fixtures for the tests that run real vLLM (CPU) engines.

They run in the vLLM venv (`make install-vllm`; `make test` runs them there) and are
skipped where vLLM is not installed. vLLM engines are heavy (start-up 15-40 s, ~2.6 GB
each): a module starts at most two or three, pinned to different cores. What they share
with the sim stack tests (tiny model, stack definition, clean-stop check, load reports)
is in tests/stack_fixtures.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.stack_fixtures import make_stack, running
from tests.vllm.observer import ALWAYS_DISAGGREGATE, LONG_LEASES
from tests.vllm.workload import MAX_TOKENS, TURN1_ANSWER, TURN2_ANSWER, SingleEngine, Workload

BLOCK = 128  # vLLM's block size on CPU


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def vllm_args(index: int, *extra: str, kv_cache_gib: float = 0.25) -> tuple[str, ...]:
    """Worker flags for the index-th engine of a stack: its own core where there is one."""
    available = cores()
    return ("--vllm-cpu-threads-bind", str(available[index % len(available)]),
            "--vllm-kv-cache-gib", str(kv_cache_gib), *extra)


def vllm_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, specs: tuple[WorkerSpec, ...],
               router_args: tuple[str, ...] = (), start_timeout_s: float = 240.0) -> LocalStack:
    return make_stack(nats_server, model_dir, log_dir, workers=0, specs=specs, router_args=router_args,
                      engine="vllm", ttl_s=3.0, start_timeout_s=start_timeout_s)


def pd_pair(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, decode_args: tuple[str, ...] = (), *,
            prefill_args: tuple[str, ...] = (), router_args: tuple[str, ...] = ()) -> Iterator[LocalStack]:
    """A started 1P1D stack (p1 on the first core, d1 on the second, every request split;
    leases far longer than any test waits), stopped at the end with nothing left behind."""
    specs = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=vllm_args(0, *LONG_LEASES, *prefill_args)),
             WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=vllm_args(1, *LONG_LEASES, *decode_args)))
    with running(vllm_stack(nats_server, model_dir, log_dir, specs,
                            router_args=(*ALWAYS_DISAGGREGATE, *router_args))) as stack:
        yield stack


@pytest.fixture
async def stack_bus(stack: LocalStack) -> AsyncIterator[Bus]:
    """A bus client of the stack a test module defines as its `stack` fixture."""
    async with await connect(stack.nats_url, "vllm-test") as bus:
        yield bus


@dataclass
class References:
    """The workload and a single vLLM engine's answers to all of it (token ids)."""

    workload: Workload
    answers: dict[tuple[int, ...], list[int]]
    answer1: list[int]  # turn 1 of the conversation
    turn2: list[int]

    def of(self, prompt: list[int]) -> list[int]:
        return self.answers[tuple(prompt)]


@pytest.fixture(scope="session")
async def references(nats_server: EmbeddedNats, tiny_model_dir: str,
                     tmp_path_factory: pytest.TempPathFactory) -> References:
    """One vLLM worker alone (role both, its own stack) answers every prompt of the
    workload; the stack stops before any P/D stack starts."""
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    workload = Workload(tokenizer.vocab_size)
    stack = vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("single-engine"),
                       (WorkerSpec(worker_id="single", role=WorkerRole.BOTH, extra_args=vllm_args(0)),))
    with running(stack):
        bus = await connect(stack.nats_url, "vllm-references")
        try:
            engine = SingleEngine(bus, stack.config.namespace, "single", tokenizer.model_name)
            for prompt in workload.prompts + workload.fault_prompts:
                await engine.answer(prompt, MAX_TOKENS)
            answer1 = await engine.answer(workload.turn1, TURN1_ANSWER)
            turn2 = workload.turn2(answer1)
            await engine.answer(turn2, TURN2_ANSWER)
        finally:
            await bus.close()
    return References(workload, engine.answers, answer1, turn2)
