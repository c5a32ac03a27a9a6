"""The sim's timing model: how long one engine step takes.

A step computes some uncached prefill tokens and one token for each decoding sequence:

    step = overhead + prefill_tokens * prefill_ms_per_token
                    + (decode_base_ms + decode_ms_per_seq * decode_seqs   if decode_seqs else 0)
                    + loaded_tokens * host_load_ms_per_token

where `loaded_tokens` are prompt tokens whose KV a step loads back from the host tier
(`host_tier`) instead of computing it. A profile that does not say how fast that is loads
at `DEFAULT_HOST_LOAD_SHARE` of the prefill cost per token: a host-to-device copy over a
PCIe-class link against prefill compute (an 8B model's KV, 128 KiB per token at ~25 GB/s,
is ~5 us a token, against ~50-100 us of prefill on an H100: a fifth is on the slow side).

Profiles are JSON files (see `profiles/default.json`). `load_profile` takes a file path or the
name of a packaged profile (a file of `profiles/` without `.json`, e.g. `h100-llama-8b-shape`,
measured on an H100 by `tandem bench calibrate`); the scheduler calls
`step_duration_s`, the engine sleeps that long divided by the speed-up factor.
`layer_weights` optionally splits a step across layers (push-mode KV transfer overlaps with
per-layer compute); empty means an even split.
"""

from __future__ import annotations

import os
from importlib import resources

import msgspec

from shared.config import ConfigError

DEFAULT_PROFILE = "default.json"
DEFAULT_HOST_LOAD_SHARE = 0.2  # a host-tier load per token, relative to prefilling it, when a profile says nothing


class TimingProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "custom"
    prefill_ms_per_token: float
    step_overhead_ms: float
    decode_base_ms: float
    decode_ms_per_seq: float
    layer_weights: list[float] = []
    host_load_ms_per_token: float | None = None  # None: DEFAULT_HOST_LOAD_SHARE x prefill_ms_per_token

    def validate(self) -> None:
        for field in ("prefill_ms_per_token", "step_overhead_ms", "decode_base_ms", "decode_ms_per_seq",
                      "host_load_ms_per_token"):
            if (getattr(self, field) or 0.0) < 0:
                raise ConfigError(f"timing profile {self.name!r}: {field} must be >= 0")
        if any(weight < 0 for weight in self.layer_weights) or (
                self.layer_weights and sum(self.layer_weights) <= 0):
            raise ConfigError(f"timing profile {self.name!r}: layer_weights must be >= 0 with a positive sum")

    @property
    def host_load_ms(self) -> float:
        """Milliseconds to load one token's KV back from the host tier."""
        if self.host_load_ms_per_token is not None:
            return self.host_load_ms_per_token
        return DEFAULT_HOST_LOAD_SHARE * self.prefill_ms_per_token

    def step_duration_s(self, *, prefill_tokens: int, decode_seqs: int, loaded_tokens: int = 0) -> float:
        """Simulated seconds for one step; 0 when the step computes nothing."""
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        ms = self.step_overhead_ms + prefill_tokens * self.prefill_ms_per_token + loaded_tokens * self.host_load_ms
        if decode_seqs:
            ms += self.decode_base_ms + decode_seqs * self.decode_ms_per_seq
        return ms / 1000.0

    def layer_fractions(self, num_layers: int) -> list[float]:
        """The share of a step each layer takes (sums to 1)."""
        if not self.layer_weights:
            return [1.0 / num_layers] * num_layers
        if len(self.layer_weights) != num_layers:
            raise ConfigError(f"timing profile {self.name!r} has {len(self.layer_weights)} layer weights, "
                              f"the engine has {num_layers} layers")
        total = sum(self.layer_weights)
        return [weight / total for weight in self.layer_weights]


def packaged_profiles() -> list[str]:
    """Names of the profiles shipped with the sim, for `--sim-profile NAME`."""
    return sorted(entry.name.removesuffix(".json") for entry in resources.files(__package__).joinpath("profiles")
                  .iterdir() if entry.name.endswith(".json"))


def _packaged_name(path: str) -> str | None:
    """`path` as a packaged profile's name, when it is a bare name and no such file exists."""
    if os.path.exists(path) or os.sep in path or (os.altsep and os.altsep in path):
        return None
    name = path.removesuffix(".json")
    return name if name in packaged_profiles() else None


def load_profile(path: str | None) -> TimingProfile:
    """The profile at `path`, or the packaged profile of that name (a file of that name
    wins), or the packaged default when `path` is empty."""
    packaged = _packaged_name(path) if path else DEFAULT_PROFILE.removesuffix(".json")
    try:
        if packaged:
            raw = resources.files(__package__).joinpath("profiles", f"{packaged}.json").read_bytes()
            source = f"packaged {packaged}.json"
        else:
            assert path
            with open(path, "rb") as file:
                raw = file.read()
            source = path
    except OSError as error:
        raise ConfigError(f"cannot read timing profile {path!r}: {error.strerror or error} "
                          f"(packaged profiles: {', '.join(packaged_profiles())})") from error
    try:
        profile = msgspec.json.decode(raw, type=TimingProfile)
    except msgspec.DecodeError as error:  # ValidationError is a DecodeError
        raise ConfigError(f"bad timing profile {source}: {error}") from error
    profile.validate()
    return profile
