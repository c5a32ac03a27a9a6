"""Timing profiles: the packaged default, step durations, clear errors on bad files."""

from __future__ import annotations

import pytest

from services.worker.sim.profile import TimingProfile, load_profile
from shared.config import ConfigError


def test_packaged_default_loads() -> None:
    profile = load_profile("")
    assert profile == load_profile(None)
    assert profile.prefill_ms_per_token == pytest.approx(0.05)
    assert profile.decode_base_ms == pytest.approx(8.0) and profile.decode_ms_per_seq == pytest.approx(0.1)


def test_step_duration() -> None:
    profile = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0,
                            decode_ms_per_seq=0.1)
    assert profile.step_duration_s(prefill_tokens=0, decode_seqs=0) == 0.0
    assert profile.step_duration_s(prefill_tokens=200, decode_seqs=0) == pytest.approx(0.011)
    assert profile.step_duration_s(prefill_tokens=100, decode_seqs=10) == pytest.approx(0.015)
    assert profile.layer_fractions(4) == [0.25] * 4


def test_layer_split() -> None:
    profile = TimingProfile(prefill_ms_per_token=0, step_overhead_ms=0, decode_base_ms=0, decode_ms_per_seq=0,
                            layer_weights=[1, 3])
    assert profile.layer_fractions(2) == [0.25, 0.75]
    with pytest.raises(ConfigError, match="2 layer weights"):
        profile.layer_fractions(4)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "bad timing profile"),
    ('{"prefill_ms_per_token": 0.1}', "missing required field"),
    ('{"prefill_ms_per_token": "fast", "step_overhead_ms": 1, "decode_base_ms": 1, "decode_ms_per_seq": 1}',
     "Expected `float`"),
    ('{"prefill_ms_per_token": -1, "step_overhead_ms": 1, "decode_base_ms": 1, "decode_ms_per_seq": 1}',
     "must be >= 0"),
    ('{"prefill_ms_per_token": 1, "step_overhead_ms": 1, "decode_base_ms": 1, "decode_ms_per_seq": 1, "x": 1}',
     "unknown field"),
])
def test_bad_profile_files(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_profile(str(path))


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read timing profile"):
        load_profile(str(tmp_path / "nope.json"))
