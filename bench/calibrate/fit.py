"""Fit the sim's timing profile to measured step times: pure functions, numpy only.

The sim's step model (services/worker/sim/profile.py):

    prefill step:  overhead + tokens * prefill_ms_per_token
    decode step:   overhead + decode_base_ms + seqs * decode_ms_per_seq

Both kinds of points go into one least-squares system over the four unknowns, each row
divided by its measured time, so a 5 ms step and a 500 ms step weigh the same (the fit
minimises relative error). A coefficient the data push below zero is pinned at zero and
the rest refitted (the profile rejects negative values). Layer weights are the measured
share of each decoder layer in a step, the embedding counted in the first layer and the
final norm and LM head in the last, averaged over the measured steps; they can be pooled
into fewer, contiguous layers for a sim with fewer layers.

`bench.calibrate.main` calls `fit_profile` on the raw measurements `bench.calibrate.measure`
writes; tests call the pieces on synthetic data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from services.worker.sim.profile import TimingProfile

UNKNOWNS = ("step_overhead_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq")


class StepFit(msgspec.Struct, frozen=True, kw_only=True):
    step_overhead_ms: float
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    max_relative_error: float  # over the points fitted: |model - measured| / measured
    mean_relative_error: float


def fit_step_model(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, float]]) -> StepFit:
    """`prefill`: (tokens in the step, ms); `decode`: (sequences in the step, ms)."""
    if len(prefill) < 2 or len(decode) < 2:
        raise ValueError("the fit needs at least two prefill and two decode points")
    if len({tokens for tokens, _ in prefill}) < 2 or len({seqs for seqs, _ in decode}) < 2:
        raise ValueError("the fit needs at least two distinct prefill sizes and two distinct decode sizes")
    rows = [[1.0, float(tokens), 0.0, 0.0] for tokens, _ in prefill]
    rows += [[1.0, 0.0, 1.0, float(seqs)] for seqs, _ in decode]
    design = np.array(rows)
    measured = np.array([ms for _, ms in prefill] + [ms for _, ms in decode], dtype=float)
    if (measured <= 0).any():
        raise ValueError("measured times must be positive")
    coefficients = _nonnegative_lstsq(design / measured[:, None], np.ones_like(measured))
    relative = np.abs(design @ coefficients - measured) / measured
    values = dict(zip(UNKNOWNS, (float(c) for c in coefficients)))
    return StepFit(**values, max_relative_error=float(relative.max()), mean_relative_error=float(relative.mean()))


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, by pinning the most negative at zero
    until none is left negative (exact for four unknowns whose columns barely interact)."""
    free = list(range(a.shape[1]))
    solution = np.zeros(a.shape[1])
    while free:
        coefficients, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (coefficients >= 0).all():
            solution[free] = coefficients
            return solution
        free.pop(int(np.argmin(coefficients)))
    return solution


def fit_layer_weights(steps: Sequence[dict[str, Any]], num_layers: int | None = None) -> list[float]:
    """Each layer's share of a step, summing to 1, pooled into `num_layers` contiguous groups
    (default: as many as measured). A step is {"embed_ms", "layer_ms": [...], "norm_ms",
    "head_ms"} as `measure` records it."""
    if not steps:
        raise ValueError("no per-layer measurements")
    shares = []
    for step in steps:
        per_layer = np.array(step["layer_ms"], dtype=float)
        if per_layer.size == 0 or (per_layer < 0).any():
            raise ValueError("per-layer times must be non-negative, one per layer")
        per_layer[0] += step.get("embed_ms", 0.0)
        per_layer[-1] += step.get("norm_ms", 0.0) + step.get("head_ms", 0.0)
        if per_layer.sum() <= 0:
            raise ValueError("per-layer times sum to zero")
        shares.append(per_layer / per_layer.sum())
    if len({share.size for share in shares}) != 1:
        raise ValueError("the steps measured different numbers of layers")
    mean = np.mean(shares, axis=0)
    groups = num_layers or mean.size
    if groups < 1 or mean.size % groups:
        raise ValueError(f"{mean.size} measured layers cannot be pooled into {groups} equal groups")
    pooled = mean.reshape(groups, -1).sum(axis=1)
    return [round(float(share), 5) for share in pooled / pooled.sum()]


def _chosen(points: list[dict[str, Any]], mode: str, size: str) -> list[tuple[int, float]]:
    """(size, median ms) of the points timed in `mode`. "auto" takes, for each shape (batch
    and length), the faster of the eager run and the CUDA-graph replay, as an engine that
    captures graphs where they help does (points recorded without a mode are eager)."""
    best: dict[tuple[int, int], tuple[int, float]] = {}
    for point in points:
        if mode in ("auto", point.get("mode", "eager")):
            shape = (point["batch"], point.get("length", 1))
            if shape not in best or point["median_ms"] < best[shape][1]:
                best[shape] = (point[size], point["median_ms"])
    return [best[shape] for shape in sorted(best)]


def prefill_points(raw: dict[str, Any], mode: str = "auto") -> list[tuple[int, float]]:
    """(tokens in the step, ms) of the measured prefill steps."""
    chosen = _chosen(raw["prefill"], mode, "tokens")
    if not chosen:
        raise ValueError(f"no {mode} prefill measurements")
    return chosen


def decode_points(raw: dict[str, Any], mode: str = "auto") -> tuple[int, list[tuple[int, float]]]:
    """The decode points at the first measured context: (context, [(seqs, ms)])."""
    points = raw["decode"]
    if not points:
        raise ValueError("no decode measurements")
    context = raw["plan"]["decode_contexts"][0] if raw.get("plan") else points[0]["context"]
    chosen = _chosen([p for p in points if p["context"] == context], mode, "batch")
    if not chosen:
        raise ValueError(f"no {mode} decode measurements at context {context}")
    return context, chosen


def fit_profile(raw: dict[str, Any], *, name: str, num_layers: int | None = None,
                mode: str = "auto") -> tuple[TimingProfile, StepFit]:
    """The validated profile for a raw measurements document, and the fit's quality."""
    prefill = prefill_points(raw, mode)
    _, decode = decode_points(raw, mode)
    fit = fit_step_model(prefill, decode)
    profile = TimingProfile(name=name, prefill_ms_per_token=round(fit.prefill_ms_per_token, 6),
                            step_overhead_ms=round(fit.step_overhead_ms, 4),
                            decode_base_ms=round(fit.decode_base_ms, 4),
                            decode_ms_per_seq=round(fit.decode_ms_per_seq, 6),
                            layer_weights=fit_layer_weights(raw["layers"], num_layers) if raw.get("layers") else [])
    profile.validate()
    return profile, fit
