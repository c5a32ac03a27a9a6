"""The calibration fit (bench/calibrate/fit.py) on synthetic measurements, and the command
fitting a raw file into a profile the sim loads: no torch involved."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.calibrate.fit import fit_layer_weights, fit_profile, fit_step_model
from cli.main import app
from services.worker.sim.profile import load_profile

TRUE = {"step_overhead_ms": 4.0, "prefill_ms_per_token": 0.03, "decode_base_ms": 2.5, "decode_ms_per_seq": 0.05}
TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192]
SEQS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def prefill_ms(tokens: int) -> float:
    return TRUE["step_overhead_ms"] + tokens * TRUE["prefill_ms_per_token"]


def decode_ms(seqs: int) -> float:
    return TRUE["step_overhead_ms"] + TRUE["decode_base_ms"] + seqs * TRUE["decode_ms_per_seq"]


def test_exact_points_give_back_the_model() -> None:
    fit = fit_step_model([(t, prefill_ms(t)) for t in TOKENS], [(n, decode_ms(n)) for n in SEQS])
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=1e-9)
    assert fit.max_relative_error < 1e-9


def test_noisy_points_fit_within_the_noise() -> None:
    rng = np.random.default_rng(7)
    noise = lambda: float(rng.uniform(0.97, 1.03))  # noqa: E731
    fit = fit_step_model([(t, prefill_ms(t) * noise()) for t in TOKENS for _ in range(3)],
                         [(n, decode_ms(n) * noise()) for n in SEQS for _ in range(3)])
    assert fit.prefill_ms_per_token == pytest.approx(TRUE["prefill_ms_per_token"], rel=0.05)
    assert fit.decode_ms_per_seq == pytest.approx(TRUE["decode_ms_per_seq"], rel=0.1)
    assert fit.step_overhead_ms + fit.decode_base_ms == pytest.approx(6.5, rel=0.05)
    assert 0 < fit.mean_relative_error < 0.03


def test_relative_weighting_keeps_short_steps_right() -> None:
    """Ordinary least squares would let the 8192-token step swamp the 128-token one."""
    prefill = [(t, prefill_ms(t) + 0.002 * t * t / 1000) for t in TOKENS]  # a mild quadratic term
    fit = fit_step_model(prefill, [(n, decode_ms(n)) for n in SEQS])
    short = fit.step_overhead_ms + 128 * fit.prefill_ms_per_token
    assert short == pytest.approx(prefill[0][1], rel=0.25)


def test_a_negative_coefficient_is_pinned_at_zero() -> None:
    # Decode steps cheaper than the prefill intercept: decode_base would come out negative.
    fit = fit_step_model([(t, 10.0 + 0.03 * t) for t in TOKENS], [(n, 6.0 + 0.05 * n) for n in SEQS])
    assert fit.decode_base_ms == 0.0
    assert min(fit.step_overhead_ms, fit.prefill_ms_per_token, fit.decode_ms_per_seq) > 0


@pytest.mark.parametrize(("prefill", "decode", "message"), [
    ([(128, 5.0)], [(1, 5.0), (2, 6.0)], "at least two"),
    ([(128, 5.0), (128, 5.1)], [(1, 5.0), (2, 6.0)], "distinct"),
    ([(128, 5.0), (256, 0.0)], [(1, 5.0), (2, 6.0)], "positive"),
])
def test_bad_points(prefill, decode, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_step_model(prefill, decode)


def layer_step(layers: list[float], embed: float = 0.0, norm: float = 0.0, head: float = 0.0) -> dict:
    return {"embed_ms": embed, "layer_ms": layers, "norm_ms": norm, "head_ms": head}


def test_layer_weights_count_embedding_first_and_head_last() -> None:
    weights = fit_layer_weights([layer_step([1.0, 1.0, 1.0, 1.0], embed=1.0, norm=0.5, head=0.5)])
    assert weights == pytest.approx([2 / 6, 1 / 6, 1 / 6, 2 / 6], abs=1e-5)


def test_layer_weights_average_steps_and_pool() -> None:
    steps = [layer_step([1.0] * 8), layer_step([3.0] * 4 + [1.0] * 4)]
    assert fit_layer_weights(steps) == pytest.approx([0.0625 + 0.1875 / 2] * 4 + [0.0625 + 0.0625 / 2] * 4,
                                                     abs=1e-5)
    assert fit_layer_weights(steps, 2) == pytest.approx([0.625, 0.375], abs=1e-5)
    with pytest.raises(ValueError, match="cannot be pooled into 3"):
        fit_layer_weights(steps, 3)
    with pytest.raises(ValueError, match="different numbers of layers"):
        fit_layer_weights([layer_step([1.0] * 8), layer_step([1.0] * 4)])
    with pytest.raises(ValueError, match="no per-layer"):
        fit_layer_weights([])


def synthetic_raw() -> dict:
    """A raw document as `measure` writes it: graph replays 1 ms faster for small prefill
    steps and for decode, slower (ignored by "auto") for the long prompts."""
    prefill = []
    for tokens in TOKENS:
        prefill.append({"batch": 1, "length": tokens, "tokens": tokens, "mode": "eager",
                        "median_ms": prefill_ms(tokens) + (1.0 if tokens <= 512 else 0.0)})
        prefill.append({"batch": 1, "length": tokens, "tokens": tokens, "mode": "cuda_graph",
                        "median_ms": prefill_ms(tokens) + (0.0 if tokens <= 512 else 5.0)})
    prefill.append({"batch": 4, "length": 512, "tokens": 2048, "mode": "eager", "median_ms": prefill_ms(2048)})
    decode = []
    for context in (1024, 4096):
        for seqs in SEQS:
            base = decode_ms(seqs) * (1 if context == 1024 else 2)
            decode.append({"batch": seqs, "context": context, "mode": "eager", "median_ms": base + 8.0})
            decode.append({"batch": seqs, "context": context, "mode": "cuda_graph", "median_ms": base})
    return {"plan": {"decode_contexts": [1024, 4096]}, "prefill": prefill, "decode": decode,
            "layers": [layer_step([1.0] * 32, embed=0.1, head=0.9)]}


def test_fit_profile_takes_the_faster_mode_per_point() -> None:
    profile, fit = fit_profile(synthetic_raw(), name="synthetic")
    assert profile.name == "synthetic" and len(profile.layer_weights) == 32
    assert profile.prefill_ms_per_token == pytest.approx(TRUE["prefill_ms_per_token"], rel=1e-3)
    assert profile.decode_ms_per_seq == pytest.approx(TRUE["decode_ms_per_seq"], rel=1e-3)
    assert profile.step_overhead_ms + profile.decode_base_ms == pytest.approx(6.5, rel=1e-3)
    assert fit.max_relative_error < 1e-6
    eager, _ = fit_profile(synthetic_raw(), name="eager", mode="eager", num_layers=4)
    assert eager.step_overhead_ms + eager.decode_base_ms == pytest.approx(6.5 + 8.0, rel=0.02)
    assert len(eager.layer_weights) == 4


def test_the_command_fits_a_raw_file_into_a_loadable_profile(tmp_path) -> None:
    raw_path, profile_path = tmp_path / "raw.json", tmp_path / "profile.json"
    raw_path.write_text(json.dumps(synthetic_raw()))
    result = CliRunner().invoke(app, ["bench", "calibrate", "--from-raw", str(raw_path), "--name", "synthetic",
                                      "--fit-layers", "4", "--profile-out", str(profile_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["decode_context"] == 1024 and report["prefill_points"] == 8 and report["decode_points"] == 9
    profile = load_profile(str(profile_path))
    assert profile.name == "synthetic" and len(profile.layer_weights) == 4
    assert report["profile"]["decode_ms_per_seq"] == profile.decode_ms_per_seq


def test_the_command_reports_a_bad_raw_file(tmp_path) -> None:
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps({**synthetic_raw(), "decode": []}))
    result = CliRunner().invoke(app, ["bench", "calibrate", "--from-raw", str(raw_path)])
    assert result.exit_code == 2 and "no decode measurements" in result.output


def test_fitting_never_imports_torch() -> None:
    code = ("import sys, bench.calibrate.main, bench.calibrate.measure; "
            "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
