"""Dynamo's mocker timed like Tandem's sim, so each system's routers face engines of the same
speed (`bench.routing.dynamo` starts the mocker; this module is pure but for `write_profile_npz`).

How the mocker (ai-dynamo 1.6.1, vLLM engine type) spends time, measured here and in its
source (lib/mocker: scheduler/vllm, common/perf_model.rs): each scheduler pass schedules
running requests first (one token each for decodes, chunks of prefill), then admits
waiting ones within `--max-num-batched-tokens` and `--max-num-seqs`; the pass then lasts

    pass_ms = prefill_ms(c) / speedup_ratio + decode_ms / (speedup_ratio * decode_speedup_ratio)

where c is the pass's prompt tokens not found in its prefix cache (0 ms when c = 0) and
decode_ms applies when some request is decoding (at least 1 ms). A request's first token
leaves at the end of the prefill part of the pass that completes its prompt; later tokens at
the end of each pass. Without a profile the times are fixed polynomials of a big GPU:

    prefill_ms(c) = 4.209989e-07 c^2 + 1.518344e-02 c + 16.50142      (c: new tokens in the pass)
    decode_ms(u)  = max(1, -25.74 u^2 + 54.01 u + 5.74)                 (u: active KV / KV pool)

Tandem's sim (`services/worker/sim/profile.py`, divided by `--sim-speedup`) has a different
shape: `step_ms = overhead + c * prefill_ms_per_token + (decode_base + n * decode_ms_per_seq
if n decoding)`. A single speed-up cannot make the polynomial match it (16.5 ms fixed per
prefill pass against 0.05 ms per token: the ratio moves with the prompt length), so the
mocker is given the sim's own timing instead, as a `--planner-profile-data` NPZ (the
"mocker format": `prefill_isl`/`prefill_ttft_ms`, linear in new tokens, and `decode_itl`
over (active KV tokens, mean context length), bilinear):

    prefill_ms(c) = step_overhead_ms + c * prefill_ms_per_token
    decode_ms(A, L) = step_overhead_ms + decode_base_ms + decode_ms_per_seq * A / L
                                                  (A / L: decoding sequences)

and `--speedup-ratio` = the bench's `--sim-speedup` (0.25 by default), decode speed-up 1,
and the bench's block size, `max_num_batched_tokens`, `max_model_len` and `max_num_seqs`.
Then a decode-only pass and a prefill-only pass last exactly the sim's step, and a pass with
both one step overhead more (1 ms of ~35 with the default profile and 512-token chunks), so
the cache-blind capacity (`EngineShape.cache_blind_capacity_rps`) is within ~3% of the sim's.
What else differs: a first token leaves the mocker before its pass's decode part (the sim
sends it at the end of the step: the mocker's TTFT is up to `(overhead + decode_base_ms) /
sim_speedup` shorter, 36 ms at the defaults), and A counts prefilling requests' blocks too
(the per-sequence term is 0.1 ms). Measured at speed-up 1 and `max_num_batched_tokens` 512,
single requests of 16-4096 prompt tokens: TTFT = 0.05 ms x prompt tokens + 5-7 ms of HTTP and
runtime overhead. Beside Tandem's sim at the bench's 0.25 (one worker each, one request of
1600 prompt tokens: TTFT 348 ms vs 439 ms; eight at once: median TTFT 1.94 s vs 2.09 s, last
answer 4.07 s vs 4.45 s; decode 36.4 vs 38.2 ms a token): the sim runs slower than its profile
by its own CPU overheads.

`polynomial_speedup` gives the other choice, the mocker's own polynomial with one speed-up
matched to the sim's cache-blind service time at one prompt length, for runs that want
Dynamo's stock engine model; its per-token and per-pass costs then differ from the sim's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from bench.routing.workloads import EngineShape
from services.worker.sim.profile import TimingProfile

POLY_PREFILL = (4.209989e-07, 1.518344e-02, 1.650142e01)  # ms: a c^2 + b c + k
POLY_DECODE = (-25.74, 54.01, 5.74)  # ms: a u^2 + b u + k, u = active KV / KV pool


def mocker_settings(shape: EngineShape, *, max_num_seqs: int | None = None) -> dict:
    """`DynamoStack` keyword arguments that give its mocker workers the sim's timing and limits
    at `shape` (the workers' count too); add `kv_blocks`, `router_mode`, `model_dir`."""
    settings = {"workers": shape.workers, "block_size": shape.block_size,
                "max_num_batched_tokens": shape.max_num_batched_tokens, "max_model_len": shape.max_model_len,
                "speedup_ratio": shape.sim_speedup, "decode_speedup_ratio": 1.0, "timing_profile": shape.profile}
    if max_num_seqs is not None:
        settings["max_num_seqs"] = max_num_seqs
    return settings


def profile_arrays(profile: TimingProfile, *, block_size: int, max_context: int,
                   max_kv_tokens: int) -> dict[str, np.ndarray]:
    """The mocker-format perf data reproducing `profile` (see the module docstring)."""
    top = float(max(max_kv_tokens, max_context, 1) * 4)  # the interpolation extrapolates linearly anyway
    prefill_isl = np.array([0.0, 1.0, top])
    prefill_ms = np.array([0.0, profile.step_overhead_ms + profile.prefill_ms_per_token,
                           profile.step_overhead_ms + profile.prefill_ms_per_token * top])
    active_kv = np.array([0.0, top])
    # A / L is hyperbolic in L: a point per block keeps the bilinear error below one sequence's cost
    context = np.unique(np.concatenate([[1.0], np.arange(block_size, max_context + block_size, block_size,
                                                         dtype=float)]))
    itl = profile.step_overhead_ms + profile.decode_base_ms + profile.decode_ms_per_seq * active_kv[:, None] / context[None, :]
    return {"prefill_isl": prefill_isl, "prefill_ttft_ms": prefill_ms, "decode_active_kv_tokens": active_kv,
            "decode_context_length": context, "decode_itl": itl}


def write_profile_npz(profile: TimingProfile, path: str | Path, *, block_size: int, max_context: int,
                      max_kv_tokens: int) -> Path:
    """Write `profile_arrays(...)` to `path` (a `.npz`, for `--planner-profile-data`)."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"the mocker reads perf data only from a .npz file, not {path}")
    np.savez(path, **profile_arrays(profile, block_size=block_size, max_context=max_context,
                                    max_kv_tokens=max_kv_tokens))
    return path


def polynomial_prefill_ms(tokens: float) -> float:
    a, b, k = POLY_PREFILL
    return a * tokens * tokens + b * tokens + k if tokens > 0 else 0.0


def polynomial_decode_ms(utilisation: float) -> float:
    a, b, k = POLY_DECODE
    u = min(max(utilisation, 0.0), 1.0)
    return max(1.0, a * u * u + b * u + k)


def polynomial_speedup(shape: EngineShape, prompt_tokens: float, *, decode_utilisation: float = 0.5,
                       decoding_seqs: int = 4) -> tuple[float, float]:
    """(`--speedup-ratio`, `--decode-speedup-ratio`) for the mocker's stock polynomials such that
    (1) a decode pass lasts the sim's decode step with `decoding_seqs` sequences, and (2) an
    uncached prompt of `prompt_tokens`, chunked by `max_num_batched_tokens` with decodes riding
    along every chunk, takes the sim's `EngineShape.uncached_request_s`. Exact at that prompt
    length only; `decode_utilisation` is the KV share the running requests hold."""
    profile = shape.profile
    chunks = max(1, math.ceil(prompt_tokens / shape.max_num_batched_tokens))
    last = prompt_tokens - (chunks - 1) * shape.max_num_batched_tokens
    prefill_ms = (chunks - 1) * polynomial_prefill_ms(shape.max_num_batched_tokens) + polynomial_prefill_ms(last)
    decode_wall_s = (profile.step_overhead_ms + profile.decode_base_ms + profile.decode_ms_per_seq * decoding_seqs
                     ) / 1000.0 / shape.sim_speedup
    prefill_wall_s = shape.uncached_request_s(prompt_tokens) - chunks * decode_wall_s
    if prefill_wall_s <= 0:
        raise ValueError("the sim's decode steps alone exceed its uncached request time: no speed-up matches")
    speedup = prefill_ms / 1000.0 / prefill_wall_s
    decode_speedup = polynomial_decode_ms(decode_utilisation) / 1000.0 / (speedup * decode_wall_s)
    return speedup, decode_speedup
