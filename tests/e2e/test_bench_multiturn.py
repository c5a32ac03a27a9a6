"""`tandem bench serve multiturn` on real sim stacks (1 prefill + 1 decode worker), prefix
pull on and off: structure, counts, and that only the pull setting pulls. Timings are
machine-dependent and not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serve.multiturn import main

pytestmark = pytest.mark.e2e


def test_multiturn_runs_both_settings_on_the_same_conversations(tiny_model_dir: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--engine", "sim", "--model-dir", tiny_model_dir, "--state-dir", str(tmp_path),
                 "--conversations", "2", "--turns", "3", "--opening-tokens", "300", "--max-tokens", "16"]) == 0
    document = json.loads(capsys.readouterr().out)

    assert [(run["label"], run["pull"]) for run in document["runs"]] == [("pull-1", True), ("no-pull-1", False)]
    for name in ("pull", "no_pull"):
        figures = document["settings"][name]
        assert (figures["requests"], figures["errors"]) == (6, 0)
        assert figures["ttft_turn1_ms"]["count"] == 2 and figures["ttft_turn2plus_ms"]["count"] == 4
        assert figures["conversation_tokens"]["min"] > 300 + 2 * 32
    assert document["same_answers_in_every_run"] is True
    pull, no_pull = (run["counters"] for run in document["runs"])
    assert pull["prefix_pulls_total"] > 0 and pull["prefix_pull"]["pulled_tokens"] > 0
    assert no_pull["prefix_pulls_total"] == 0 and no_pull["prefix_pull"]["transfers"] == 0
    assert pull["disaggregated_requests_total"] == no_pull["disaggregated_requests_total"] == 6
    assert set(document["ratios"]) == {"ttft_turn2plus_p50", "ttft_turn2plus_p90"}
