"""`tandem bench index`: a small run as a user runs it (Tandem's figures; Dynamo's binding is
not installed here), and the timing that splits a call's CPU between its thread and others."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from bench.index_wire import timed


def test_a_quick_run_reports_every_round_and_the_box_load(tmp_path) -> None:
    out = tmp_path / "index.json"
    completed = subprocess.run([sys.executable, "-m", "cli.main", "bench", "index", "--quick", "--no-dynamo",
                                "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    document = json.loads(completed.stdout)
    assert json.loads(out.read_text()) == document
    assert [fleet["workers"] for fleet in document["fleets"]] == [4, 64]
    for fleet in document["fleets"]:
        assert len(fleet["rounds"]) == 2
        for row in fleet["rounds"]:
            assert row["tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids"] > 0
            before, after = row["load_average_1m"]
            assert before >= 0 and after >= 0
            assert "dynamo_ingest_blocks_per_s" not in row  # no Dynamo figures without its binding


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_timed_tells_the_calling_threads_cpu_from_the_processs() -> None:
    def handed_off() -> None:  # as Dynamo's apply_event does: work on a thread of its own
        worker = threading.Thread(target=_spin, args=(0.2,))
        worker.start()
        worker.join()

    wall, cpu, thread = timed(handed_off)
    assert cpu >= 0.15 and thread < 0.05 and wall >= 0.15

    wall, cpu, thread = timed(lambda: _spin(0.1))
    assert thread >= 0.09 and cpu >= thread - 0.005  # the two clocks are read a moment apart
