"""`tandem status`'s terminal view on plain data: one row per worker in role order, workers
gone lately and recent errors below, the collector's answer decoded as typed structs."""

from __future__ import annotations

import msgspec
from rich.console import Console

from cli.status import _decoder, status_view
from services.metrics.cluster_view import ClusterView
from shared.schemas import RequestRecord, WorkerRole
from tests.unit.test_cluster_view import load, registration
from tests.unit.test_rank_metrics import layout


def rendered(view: ClusterView, now: float) -> str:
    console = Console(record=True, width=200, color_system=None)
    status = _decoder.decode(msgspec.json.encode(view.status(now)))  # as it arrives from /cluster
    console.print(status_view(status))
    return console.export_text()


def test_rows_in_role_order_with_load_kv_and_versions() -> None:
    view = ClusterView()
    view.apply_registration(registration("decode-1", WorkerRole.DECODE))
    view.apply_registration(registration("prefill-1", WorkerRole.PREFILL))
    view.apply_load(load("decode-1", running=3, waiting=1, used=25))
    text = rendered(view, now=10.0)
    rows = [line for line in text.splitlines() if "│" in line and "worker" not in line]
    assert [row.split("│")[1].strip() for row in rows] == ["prefill-1", "decode-1"]
    decode = rows[1].split("│")
    assert [cell.strip() for cell in decode[2:7]] == ["decode", "active", "3", "1", "25/100 (25%)"]
    assert "sim" in rows[1] and "tiny" in rows[1]
    assert "2 workers · running 3 · waiting 1" in text


def test_the_shape_column_shows_how_each_workers_kv_is_cut() -> None:
    view = ClusterView()
    tp2 = registration("decode-1", WorkerRole.DECODE)
    tp2.kv_layout = layout(tensor_parallel=2, block_size=128)
    view.apply_registration(tp2)
    view.apply_registration(registration("decode-2", WorkerRole.DECODE))  # registered without a layout
    text = rendered(view, now=1.0)
    header = next(line for line in text.splitlines() if "worker" in line and "┃" in line)
    column = [cell.strip() for cell in header.split("┃")].index("shape")
    rows = {cells[1].strip(): cells[column].strip() for line in text.splitlines()
            if "│" in line for cells in [line.split("│")]}
    assert rows == {"decode-1": "tp2 pp1 bs128", "decode-2": "-"}


def test_gone_workers_and_errors_listed() -> None:
    view = ClusterView()
    view.apply_registration(registration("w1"))
    view.remove_worker("w1", now=5.0)
    view.apply_request(RequestRecord(request_id="r9", model="tiny", worker_id=None, outcome="unavailable",
                                     finish_reason=None, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                                     ttft_s=None, duration_s=0.1), now=6.0)
    text = rendered(view, now=8.0)
    assert "gone lately" in text and "3 s ago" in text and "lost" in text
    assert "recent errors" in text and "unavailable" in text and "heartbeat_lost" in text
    assert "0 workers" in text
