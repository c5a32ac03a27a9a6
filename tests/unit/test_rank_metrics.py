"""Each worker's KV ranks in the collector: the load snapshot's per-rank transfer counters
exported as Prometheus counters by worker, rank and op (failures by outcome too), and the
worker's shape from its registration's KvLayout, on plain data."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.metrics.cluster_view import ClusterView, shape_label
from services.metrics.exposition import build_registry, render
from shared.compat import KvLayout
from shared.schemas.load import RankTransfers, TransferTotals
from tests.unit.test_cluster_view import load, registration


def layout(**cut: int) -> KvLayout:
    return KvLayout(model="tiny", dtype="float16", block_size=cut.pop("block_size", 16), num_layers=4,
                    num_kv_heads=4, head_size=32, engine="sim", **cut)


def scrape(view: ClusterView) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry, _ = build_registry(view, {})
    body, _ = render(registry, None)
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def labels(worker: str, rank: int, op: str, **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"worker": worker, "rank": str(rank), "op": op, **more}.items()))


def test_rank_counters_by_worker_rank_and_op() -> None:
    view = ClusterView()
    view.apply_registration(registration("d1"))
    view.apply_registration(registration("p1"))
    snapshot = load("d1")
    snapshot.kv_ranks = [
        RankTransfers(rank=0, reads=TransferTotals(transfers=4, nbytes=8192, seconds=0.25, descriptors=6, failed=1),
                      writes=TransferTotals(transfers=2, cancelled=2)),
        RankTransfers(rank=1, reads=TransferTotals(transfers=3, nbytes=4096, seconds=0.125, descriptors=3)),
    ]
    view.apply_load(snapshot)
    samples = scrape(view)
    assert samples["tandem_kv_rank_transfer_bytes_total", labels("d1", 0, "read")] == 8192
    assert samples["tandem_kv_rank_transfer_bytes_total", labels("d1", 1, "read")] == 4096
    assert samples["tandem_kv_rank_transfer_seconds_total", labels("d1", 0, "read")] == 0.25
    assert samples["tandem_kv_rank_transfer_descriptors_total", labels("d1", 0, "read")] == 6
    assert samples["tandem_kv_rank_transfers_total", labels("d1", 0, "write")] == 2
    assert samples["tandem_kv_rank_transfer_failures_total", labels("d1", 0, "read", outcome="failed")] == 1
    assert samples["tandem_kv_rank_transfer_failures_total", labels("d1", 0, "write", outcome="cancelled")] == 2
    assert samples["tandem_kv_rank_transfer_failures_total", labels("d1", 1, "write", outcome="failed")] == 0
    rank_samples = [key for key in samples if key[0].startswith("tandem_kv_rank_")]
    assert len(rank_samples) == 4 * 4 + 4 * 2  # 2 ranks x 2 ops: four counters and two failure outcomes
    assert not [key for key in rank_samples if ("worker", "p1") in key[1]]  # p1 reported no ranks

    view.remove_worker("d1")  # a worker that left takes its series with it
    assert not [key for key in scrape(view) if key[0].startswith("tandem_kv_rank_")]


def test_the_worker_shape_comes_from_its_kv_layout() -> None:
    assert shape_label(layout(tensor_parallel=2, block_size=128)) == "tp2 pp1 bs128"
    assert shape_label(layout(pipeline_parallel=4)) == "tp1 pp4 bs16"
    assert shape_label(None) == ""
    view = ClusterView()
    with_layout = registration("w1")
    with_layout.kv_layout = layout(tensor_parallel=4, pipeline_parallel=2, block_size=32)
    view.apply_registration(with_layout)
    view.apply_registration(registration("w2"))
    shapes = {worker.worker_id: worker.shape for worker in view.status(now=1.0).workers}
    assert shapes == {"w1": "tp4 pp2 bs32", "w2": ""}
