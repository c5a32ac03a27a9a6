"""The routing benchmarks' mixed-shape fleets (`bench.routing.fleet_shapes`, pure)."""

from __future__ import annotations

import pytest

from bench.routing.fleet_shapes import WorkerShape, parse_shapes, worker_groups


def test_shapes_parse_and_name_themselves() -> None:
    shapes = parse_shapes("tp1, tp2-bs32 ,pp2-tp2")
    assert shapes == (WorkerShape(), WorkerShape(tensor_parallel=2, block_size=32),
                      WorkerShape(tensor_parallel=2, pipeline_parallel=2))
    assert [shape.name for shape in shapes] == ["tp1", "tp2-bs32", "tp2-pp2"]
    for bad in ("tp0", "gpu2", "tp2-bs"):
        with pytest.raises(ValueError, match="not a worker shape"):
            parse_shapes(bad)


def test_workers_take_the_shapes_in_turn_and_keep_the_runs_kv_in_tokens() -> None:
    groups = worker_groups(5, parse_shapes("tp1,tp2-bs32"), engine="sim", settings={"sim_speedup": 2.0},
                           block_size=16, kv_blocks=100)
    assert [(group.name, group.count) for group in groups] == [("worker-tp1", 3), ("worker-tp2-bs32", 2)]
    assert groups[1].settings == {"sim_speedup": 2.0, "tensor_parallel": 2, "pipeline_parallel": 1, "block_size": 32,
                                  "kv_blocks": 50}
    (alike,) = worker_groups(4, (), engine="sim", settings={}, block_size=16, kv_blocks=100)
    assert (alike.count, alike.settings) == (4, {"kv_blocks": 100})
