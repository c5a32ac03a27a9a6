"""`tandem bench transfer` on host memory, small: every variant of both operations moves the
right bytes over real NIXL (the bench checks each on the receiving side), and a bench on
GPU memory without a GPU says so before it starts a process."""

from __future__ import annotations

import importlib.util

import pytest

from bench.transfer import run_transfer_bench
from connector.nixl_agent import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


def test_pulls_and_pushes_of_both_layouts_move_the_right_bytes():
    report = run_transfer_bench(num_blocks=32, block_nbytes=4096, repeats=2, idle_seconds=0.2,
                                compare_stock_agent=False)
    assert report["memory"] == "dram" and set(report) >= {"reads", "writes", "goals", "idle_cpu_percent"}
    for op in ("reads", "writes"):
        adjacent, scattered = report[op]["adjacent"], report[op]["scattered"]
        assert adjacent["verified"] and scattered["verified"], report[op]
        assert adjacent["connector_descriptors"] == adjacent["connector_ranges_descriptors"] == 1
        assert scattered["raw_nixl_descriptors"] == 32 and scattered["connector_descriptors"] > 1
        assert "device_copy_p50_ms" not in adjacent  # GPU memory only


def test_gpu_memory_without_a_gpu_is_refused_up_front():
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has a GPU: tests/gpu/device_run.sh runs the GPU bench")
    with pytest.raises(RuntimeError, match="--memory vram needs"):
        run_transfer_bench(memory="vram", num_blocks=4, repeats=1, compare_stock_agent=False)


def test_unknown_memory_and_operations_are_refused():
    with pytest.raises(ValueError, match="memory"):
        run_transfer_bench(memory="hbm", compare_stock_agent=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ops"):
        run_transfer_bench(ops=("COPY",), compare_stock_agent=False)  # type: ignore[arg-type]
