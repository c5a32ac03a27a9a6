"""The router's interference settings for an `Nxany` arm of `tandem bench serve`: what a
millisecond between tokens is worth against one to the first token (`itl_weight`, from the
SLOs), how many prompt tokens a decoding request absorbs before its time per output token
reaches the ITL SLO (`itl_budget_tokens`), and what decodes add to a prompt computed beside
them (`shared_step_weight`); the last two from the engine's timings where the bench knows
them (the sim's timing profile, and the workers' step budget). docs/routing.md derives all
three. Pure but for reading the profile; called by `bench.serve.main`."""

from __future__ import annotations

from bench.serve.stats import Slo


def interference_settings(slo: Slo | None, max_tokens: int, *, engine: str, sim_profile: str = "",
                          sim_speedup: float = 1.0) -> dict[str, float]:
    """`itl_weight` (1 without an SLO), `itl_budget_tokens` (0, every token priced, without an
    SLO or where the engine's timings are not known: a vLLM engine) and `shared_step_weight`
    (0, off, where they are not known)."""
    from services.router.routing.calibration import (
        EngineTiming,
        shared_step_weight,
        slo_itl_budget_tokens,
        slo_itl_weight,
    )

    tokens = max(max_tokens, 1)
    settings = {"itl_weight": slo_itl_weight(slo.ttft_ms, slo.itl_ms, tokens) if slo else 1.0,
                "itl_budget_tokens": 0.0, "shared_step_weight": 0.0}
    if engine == "sim":
        from services.worker.sim.profile import load_profile
        profile = load_profile(sim_profile or None)
        timing = EngineTiming(profile.prefill_ms_per_token, profile.step_overhead_ms, profile.decode_base_ms,
                              profile.decode_ms_per_seq, _worker_default("max_num_seqs"), speedup=sim_speedup)
        settings["shared_step_weight"] = shared_step_weight(timing, _worker_default("max_num_batched_tokens"))
        if slo is not None:
            settings["itl_budget_tokens"] = slo_itl_budget_tokens(slo.itl_ms, tokens, timing)
    return settings


def _worker_default(name: str) -> int:
    """A batching bound of the bench's workers (they run with `WorkerConfig`'s defaults)."""
    import msgspec

    from shared.config import WorkerConfig

    return next(field.default for field in msgspec.structs.fields(WorkerConfig) if field.name == name)
