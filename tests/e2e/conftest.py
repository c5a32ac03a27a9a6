"""End-to-end fixtures: the whole stack of sim workers as separate processes, from the
same definition `tandem up` uses, driven by the official `openai` client.

One stack per module (a stack start costs seconds); each test that asks for `loads`
checks afterwards that every worker's KV pool is back to its baseline, and teardown
checks no process is left. What the vLLM stack tests share with these lives in
tests/stack_fixtures.py (`make_stack`, `LoadWatcher` are re-exported here). Also here: the
served model's name (`model`), an OTLP receiver for a module's stack (`receiver`), and a
stack whose router splits every request (`disaggregating`, `ALWAYS_DISAGGREGATE`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import CONTROL_SERVICES, LocalStack
from shared.bus import Bus, connect
from shared.nats_server import EmbeddedNats
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import LoadWatcher, make_stack, running

__all__ = ["ALWAYS_DISAGGREGATE", "LoadWatcher", "disaggregating", "make_stack"]

pytestmark = pytest.mark.e2e

# Short prompts are served on the decode worker alone by default (conditional
# disaggregation); the tests about the hand-off split every request.
ALWAYS_DISAGGREGATE = ("--local-prefill-tokens", "0")


def disaggregating(nats_server: EmbeddedNats, model_dir: str, log_dir: Path,
                   specs: tuple[WorkerSpec, ...]) -> Iterator[LocalStack]:
    """A started stack of `specs` alone whose router splits every request, stopped at the end
    with nothing left behind."""
    with running(make_stack(nats_server, model_dir, log_dir, workers=0, router_args=ALWAYS_DISAGGREGATE,
                            specs=specs)) as stack:
        yield stack


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("stack-logs"))) as local:
        yield local


@pytest.fixture(scope="module")
def model(tiny_model_dir: str) -> str:
    """The tiny model's served name."""
    return Tokenizer.from_model_dir(tiny_model_dir).model_name


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """An OTLP/HTTP receiver for the module's stack to export its spans to."""
    otlp = OtlpReceiver().start()
    yield otlp
    otlp.stop()


@pytest.fixture
def client(stack: LocalStack, openai_client) -> openai.AsyncOpenAI:
    return openai_client(stack.router_url)


@pytest.fixture
async def stack_bus(stack: LocalStack) -> AsyncIterator[Bus]:
    async with await connect(stack.nats_url, "e2e-test") as bus:
        yield bus


@pytest.fixture
async def loads(stack: LocalStack, stack_bus: Bus) -> AsyncIterator[LoadWatcher]:
    watcher = LoadWatcher()
    await watcher.start(stack_bus, Subjects(stack.config.namespace).load_all)
    yield watcher
    live = [name for name, process in stack.processes.items() if process.alive and name not in CONTROL_SERVICES]
    await watcher.wait_idle(live)
