"""The router's interference settings for an `Nxany` arm of `tandem bench serve`: what a
millisecond between tokens is worth against one to the first token (`itl_weight`, from the
SLOs), and how many prompt tokens a decoding request absorbs before its time per output
token reaches the ITL SLO (`itl_budget_tokens`, from the engine's timings where the bench
knows them: the sim's timing profile). docs/routing.md derives both. Pure but for reading
the profile; called by `bench.serve.main`."""

from __future__ import annotations

from bench.serve.stats import Slo


def interference_settings(slo: Slo | None, max_tokens: int, *, engine: str, sim_profile: str = "",
                          sim_speedup: float = 1.0) -> dict[str, float]:
    """`itl_weight` (1 without an SLO) and, for the sim with an SLO, `itl_budget_tokens` (0, every
    token priced, where the engine's timings are not known: a vLLM engine)."""
    from services.router.routing.calibration import EngineTiming, slo_itl_budget_tokens, slo_itl_weight

    tokens = max(max_tokens, 1)
    if slo is None:
        return {"itl_weight": 1.0, "itl_budget_tokens": 0.0}
    settings = {"itl_weight": slo_itl_weight(slo.ttft_ms, slo.itl_ms, tokens), "itl_budget_tokens": 0.0}
    if engine == "sim":
        from services.worker.sim.profile import load_profile
        profile = load_profile(sim_profile or None)
        timing = EngineTiming(profile.prefill_ms_per_token, profile.step_overhead_ms, profile.decode_base_ms,
                              profile.decode_ms_per_seq, _default_max_num_seqs(), speedup=sim_speedup)
        settings["itl_budget_tokens"] = slo_itl_budget_tokens(slo.itl_ms, tokens, timing)
    return settings


def _default_max_num_seqs() -> int:
    """The workers' batch bound: the bench's workers run with `WorkerConfig`'s default."""
    import msgspec

    from shared.config import WorkerConfig

    return next(field.default for field in msgspec.structs.fields(WorkerConfig) if field.name == "max_num_seqs")
