"""Calibration: the cost model's weights from an engine's measured timings. Pure.

The cost model (`cost`) counts in prompt-token equivalents: the time one worker takes to
compute one prompt token. Every other term is a time divided by that one:

- `transfer_weight`: moving one token's KV from a holder (bytes per token / bandwidth);
- `pull_fixed_tokens`: one pull's fixed cost (the lease round trip, the hand-off);
- `decode_weight`: what a full batch adds to a new request's time to first token: it waits
  for the step in progress and computes in a step that also carries every running
  sequence (two steps of `decode_base + max_num_seqs x decode_per_seq`);
- `request_overhead_tokens`: a request's work beyond the prompt tokens it computes: the
  fixed part of one engine step (`step_overhead + decode_base`);
- `host_load_weight` (`host_load_weight`): loading one token's KV back from a host-memory
  tier, over computing it (the sim's `TimingProfile.host_load_ms`, or a measured copy);
- `itl_weight` (`slo_itl_weight`): what a millisecond of a decoding request's delay is worth
  against a millisecond of a new request's wait for its first token, from the SLOs;
- `itl_budget_tokens` (`slo_itl_budget_tokens`): how many prompt tokens a decoding request
  may share its steps with before its time per output token reaches the ITL SLO.

The inputs are plain numbers: an engine's timing profile (the sim's `TimingProfile`, or a
profile measured on a real engine) and a measured transfer (`tandem bench transfer`). Wall
times that do not scale with an engine's speed (the network, NATS) are given in wall
milliseconds with the engine's `speedup` (a sim slowed or sped up), so the ratio stays true
on the machine that runs it. Who calls it: the routing benchmark, and operators who turn
the figures into the router's `--transfer-weight`, `--pull-fixed-tokens`, `--decode-weight`,
`--request-overhead-tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTiming:
    prefill_ms_per_token: float
    step_overhead_ms: float
    decode_base_ms: float
    decode_ms_per_seq: float
    max_num_seqs: int
    speedup: float = 1.0  # engine time / wall time (a sim's speed-up; 1 for a real engine)

    def __post_init__(self) -> None:
        if self.prefill_ms_per_token <= 0 or self.speedup <= 0 or self.max_num_seqs <= 0:
            raise ValueError("prefill_ms_per_token, speedup and max_num_seqs must be positive")

    @property
    def wall_ms_per_prompt_token(self) -> float:
        return self.prefill_ms_per_token / self.speedup


@dataclass(frozen=True, slots=True)
class TransferTiming:
    kv_bytes_per_token: float  # every layer's K and V of one token
    gbps: float  # measured bandwidth of a pull, GB/s
    round_trip_ms: float  # wall ms of one pull's fixed part (lease request and release)

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.kv_bytes_per_token < 0 or self.round_trip_ms < 0:
            raise ValueError("gbps must be positive; bytes per token and round trip not negative")


def calibrated_weights(engine: EngineTiming, transfer: TransferTiming) -> dict[str, float]:
    """`RoutingConfig` fields (transfer_weight, pull_fixed_tokens, decode_weight,
    request_overhead_tokens) for these timings."""
    per_token_ms = engine.wall_ms_per_prompt_token
    transfer_ms_per_token = transfer.kv_bytes_per_token / (transfer.gbps * 1e9) * 1e3
    full_step_ms = engine.step_overhead_ms + engine.decode_base_ms + engine.max_num_seqs * engine.decode_ms_per_seq
    return {
        "transfer_weight": round(transfer_ms_per_token / per_token_ms, 4),
        "pull_fixed_tokens": round(transfer.round_trip_ms / per_token_ms, 1),
        "decode_weight": round(2 * full_step_ms / engine.prefill_ms_per_token, 1),
        "request_overhead_tokens": round((engine.step_overhead_ms + engine.decode_base_ms)
                                         / engine.prefill_ms_per_token, 1),
    }


def host_load_weight(prefill_ms_per_token: float, host_load_ms_per_token: float) -> float:
    """`RoutingConfig.host_load_weight` for an engine that prefills a token in
    `prefill_ms_per_token` and loads its KV from host memory in `host_load_ms_per_token`
    (both engine times: a sim's speed-up scales them alike)."""
    if prefill_ms_per_token <= 0 or host_load_ms_per_token < 0:
        raise ValueError("prefill time must be positive and load time not negative")
    return round(host_load_ms_per_token / prefill_ms_per_token, 4)


def slo_itl_weight(slo_ttft_ms: float, slo_itl_ms: float, output_tokens: int) -> float:
    """`RoutingConfig.itl_weight` for latency SLOs (`slo_ttft_ms` to the first token,
    `slo_itl_ms` between tokens) and answers of about `output_tokens` tokens.

    A prompt token computed on a worker delays each request decoding there by one prompt
    token's compute (chunked prefill shares their steps): 1/output_tokens of that request's
    time per output token. The SLOs value a millisecond of time per output token at
    slo_ttft / slo_itl milliseconds of time to first token, so the delay costs
    slo_ttft / slo_itl / output_tokens prompt-token equivalents per request per token. Both
    sides count in one worker's compute time, so the engine's speed cancels out."""
    if slo_ttft_ms <= 0 or slo_itl_ms <= 0 or output_tokens < 1:
        raise ValueError("SLOs must be positive and answers at least one token long")
    return round(slo_ttft_ms / slo_itl_ms / output_tokens, 3)


def slo_itl_budget_tokens(slo_itl_ms: float, output_tokens: int, engine: EngineTiming) -> float:
    """`RoutingConfig.itl_budget_tokens` for an ITL SLO of `slo_itl_ms` (wall ms per output
    token after the first) and answers of about `output_tokens` tokens on `engine`.

    A request decoding in full batches takes `step_overhead + decode_base + max_num_seqs x
    decode_per_seq` per token; every prompt token computed in its steps adds one prompt
    token's compute to its total. Its time per output token reaches the SLO once those
    additions fill the gap over its `output_tokens` steps: (slo_itl - full step) x
    output_tokens / prefill time per token, in wall time (a sim's speed-up scales both engine
    times). 0 where a full batch alone misses the SLO: then every stall counts."""
    if slo_itl_ms <= 0 or output_tokens < 1:
        raise ValueError("the ITL SLO must be positive and answers at least one token long")
    full_step_ms = (engine.step_overhead_ms + engine.decode_base_ms
                    + engine.max_num_seqs * engine.decode_ms_per_seq) / engine.speedup
    return round(max(0.0, slo_itl_ms - full_step_ms) * output_tokens / engine.wall_ms_per_prompt_token)
