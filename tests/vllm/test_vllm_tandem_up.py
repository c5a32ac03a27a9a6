"""`make run`'s default: `tandem up --engine vllm` (1 prefill + 1 decode vLLM worker, each
pinned to its own core) serves the OpenAI API and, on Ctrl-C, stops with every process
gone, vLLM's EngineCore and model workers included."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from tests.e2e.test_tandem_up import serve_and_stop  # noqa: E402

pytestmark = pytest.mark.e2e


def test_tandem_up_with_vllm_serves_and_stops_cleanly_on_ctrl_c(tmp_path: Path, tiny_model_dir: str) -> None:
    processes = serve_and_stop(tmp_path, tiny_model_dir, "--engine", "vllm", start_timeout_s=300, ctrl_c=True)
    assert len(processes) >= 10  # nats, orchestrator, metrics, router, 2 workers with 2 vLLM processes each
