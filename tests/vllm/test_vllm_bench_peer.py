"""`tandem bench serve --compare 1x1,1xvllm`: a Tandem vLLM worker and its peer, a plain
vLLM server behind vllm-router, on the same workload with an SLO.

Real processes on both sides (Tandem's stack; vLLM's OpenAI server and vllm-router from the
vLLM venv). Timings are machine-dependent: the test checks that every request of each side
is answered in full, that the goodput figures are there, and that the peer leaves no
process behind."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from bench.serve.main import CompareSetup, ServeWorkload, compare  # noqa: E402
from bench.serve.peer import router_binary  # noqa: E402
from bench.serve.prompts import PromptSpec  # noqa: E402
from bench.serve.stats import Slo  # noqa: E402
from bench.serve.topology import parse_topologies  # noqa: E402

pytestmark = pytest.mark.e2e


def test_tandem_and_the_vllm_router_peer_answer_the_same_workload(tiny_model_dir: str, tmp_path: Path) -> None:
    assert Path(router_binary()).exists()  # installed by make install-vllm
    workload = ServeWorkload(prompts=PromptSpec(count=4, prompt_tokens=200, seed=3), max_tokens=8, concurrency=2,
                             warmup=1, ignore_eos=True, slo=Slo(ttft_ms=60_000, itl_ms=60_000))
    setup = CompareSetup(engine="vllm", model_dir=tiny_model_dir, log_root=tmp_path)

    document = compare(parse_topologies("1x1,1xvllm"), workload, setup)

    for name, results in document["topologies"].items():
        assert "error" not in results, (name, results)
        assert (results["requests"], results["errors"], results["output_tokens"]) == (4, 0, 4 * 8), (name, results)
        assert results["slo"]["met"] == 4 and results["slo"]["goodput_rps"] > 0, (name, results["slo"])
    assert document["topologies"]["1xvllm"]["disaggregated_requests"] is None  # not Tandem: no router metrics
    assert document["ratios"]["goodput"] is not None
    left = [p.cmdline() for p in psutil.Process().children(recursive=True)
            if any("vllm-router" in part or "api_server" in part for part in p.cmdline())]
    assert not left, left
