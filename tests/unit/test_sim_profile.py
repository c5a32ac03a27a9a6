"""Timing profiles: the packaged default, step durations, clear errors on bad files."""

from __future__ import annotations

import pytest

from services.worker.sim.profile import TimingProfile, load_profile, packaged_profiles
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


def test_packaged_profiles_load_by_name() -> None:
    names = packaged_profiles()
    assert {"default", "h100-llama-8b-shape"} <= set(names)
    assert load_profile("default") == load_profile("")
    for name in names:
        profile = load_profile(name)
        assert profile == load_profile(f"{name}.json")
        assert profile.step_duration_s(prefill_tokens=512, decode_seqs=8) > 0


def test_packaged_h100_profile_is_the_measured_shape() -> None:
    profile = load_profile("h100-llama-8b-shape")
    assert profile.name == "h100-llama-8b-shape"
    fractions = profile.layer_fractions(32)  # one weight per decoder layer of the 8B shape
    assert sum(fractions) == pytest.approx(1.0)
    assert fractions[-1] > fractions[1]  # the last layer carries the LM head
    with pytest.raises(ConfigError, match="32 layer weights, the engine has 4 layers"):
        profile.layer_fractions(4)
    # A 2048-token prefill step and a 64-sequence decode step, in the measured range.
    assert 0.04 < profile.step_duration_s(prefill_tokens=2048, decode_seqs=0) < 0.09
    assert 0.005 < profile.step_duration_s(prefill_tokens=0, decode_seqs=64) < 0.02


def test_a_file_wins_over_a_packaged_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text('{"prefill_ms_per_token": 9, "step_overhead_ms": 1, "decode_base_ms": 1, '
                                      '"decode_ms_per_seq": 1}')
    assert load_profile("default").prefill_ms_per_token == 9


def test_unknown_name_lists_the_packaged_profiles() -> None:
    with pytest.raises(ConfigError, match="cannot read timing profile 'h200-nope'.*h100-llama-8b-shape"):
        load_profile("h200-nope")
