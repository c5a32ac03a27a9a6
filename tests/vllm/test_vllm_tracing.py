"""Tracing through real vLLM (CPU) engines: a 1P1D stack exports its spans over OTLP/HTTP to
a receiver in the test. A P/D request is one trace, continued from the client's
`traceparent`: the router's spans, each worker's `worker.generate`, the KV hand-off (the
prefill worker's lease grant, the decode worker's `kv.pull` and the release it sends the
holder), and vLLM's own `llm_request` span as a child of the worker's `worker.generate`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats, pid_alive  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.test_tracing import HTTP_SPAN, ClientSpan, check_tree, complete, part, received_trace  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402
from tests.vllm.conftest import BLOCK, vllm_args, vllm_stack  # noqa: E402
from tests.vllm.observer import ALWAYS_DISAGGREGATE, LONG_LEASES  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def traced_pd(nats_server: EmbeddedNats, tiny_model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, OtlpReceiver]]:
    receiver = OtlpReceiver().start()
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)
    specs = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=vllm_args(0, *LONG_LEASES, *tracing)),
             WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=vllm_args(1, *LONG_LEASES, *tracing)))
    stack = vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-tracing"), specs,
                       router_args=(*ALWAYS_DISAGGREGATE, *tracing))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # Tandem's and vLLM's batch processors alike
        stack.start()
    pids = [process.pid for process in stack.processes.values()]
    try:
        yield stack, receiver
    finally:
        stack.stop()
        receiver.stop()
    assert not [pid for pid in pids if pid_alive(pid)], "processes left behind"


async def test_pd_request_through_vllm_is_one_trace_with_vllms_span(traced_pd: tuple[LocalStack, OtlpReceiver],
                                                                     tiny_model_dir: str) -> None:
    stack, receiver = traced_pd
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = ClientSpan()
    prompt = [3 + (i * 13) % 500 for i in range(2 * BLOCK + 20)]
    trace_id, request_id = await complete(stack.router_url, model, prompt, 6, client)
    assert trace_id == client.trace_id
    found = await received_trace(receiver, client, {HTTP_SPAN, "kv.pull", "kv.lease.release", "llm_request"},
                                 timeout_s=20)
    check_tree(found, client, request_id)
    generate = found.child(found.only(HTTP_SPAN), "router.generate")
    _, prefill = part(found, generate, "router.prefill", "p1")
    _, decode = part(found, generate, "router.decode", "d1")
    grant = found.child(prefill, "kv.lease.grant", **{"tandem.kv.reader_worker_id": "decode"})
    assert grant.attributes["tandem.kv.blocks"] == len(prompt) // BLOCK  # the full blocks (the partial one rides along)
    pull = found.child(decode, "kv.pull", **{"tandem.kv.kind": "pull", "tandem.kv.peer_worker_id": "p1"})
    # the 2 full blocks and the prompt's partial last one
    assert pull.attributes["tandem.kv.outcome"] == "done" and pull.attributes["tandem.kv.blocks_ok"] == 3
    assert pull.attributes["tandem.kv.bytes"] > 0
    assert found.child(pull, "kv.lease.release").service == "tandem-worker-p1"
    # vLLM's own request span, joined under each worker's span (made by the worker's tracer provider)
    for worker in (prefill, decode):
        assert found.child(worker, "llm_request").service == worker.service
