"""Per-role pressures and their hysteresis tracking (pure).

A role's pressure is the worst of its ratios to target: prefill, TTFT p90 over its SLO, the
time its queued prompt tokens take at its capacity over the same SLO, and prompt-token
demand over capacity; decode, ITL p90 over its SLO, batch occupancy over its
target and KV usage over its target. 1.0 is "at the SLO". Each role has a hot trend (up)
and a cold trend (down), updated every tick by `track`. `after_one_fewer` estimates a
role's pressure with one worker fewer (a switch's donor, a scale-down).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.orchestrator.planning.model import RoleLoad, Slos, Thresholds, Trend
from shared.schemas.membership import WorkerRole


@dataclass(frozen=True, slots=True)
class Pressure:
    value: float
    why: str  # the ratio that dominates, in words
    latency: float = 0.0  # the worst latency ratio (TTFT or ITL p90 over its SLO)
    utilisation: float | None = None  # the worst utilisation ratio (demand, occupancy, KV); None: none known


def _worst(latency: tuple[float, str], utilisation: list[tuple[float, str]]) -> Pressure:
    value, why = max([latency, *utilisation], key=lambda term: term[0])
    return Pressure(value=value, why=why, latency=latency[0],
                    utilisation=max(term[0] for term in utilisation) if utilisation else None)


def role_pressure(role: WorkerRole, load: RoleLoad, slos: Slos, thresholds: Thresholds) -> Pressure:
    if role is WorkerRole.PREFILL:
        latency = (load.ttft_p90_ms / slos.ttft_p90_ms,
                   f"TTFT p90 {load.ttft_p90_ms:.0f} ms vs SLO {slos.ttft_p90_ms:.0f} ms "
                   f"(queue p90 {load.queue_time_p90_ms:.0f} ms)")
        utilisation = []
        if load.prefill_capacity_tok_s > 0:
            # What a prompt arriving now waits for: known at once, where a TTFT is known only
            # once its request ends (for long prompts, a minute or more after the queue grew).
            backlog = sum(worker.load for worker in load.workers)
            wait_ms = backlog / load.prefill_capacity_tok_s * 1000.0
            latency = max(latency, (wait_ms / slos.ttft_p90_ms,
                                    f"{backlog:.0f} queued prompt tokens: {wait_ms:.0f} ms to compute at "
                                    f"{load.prefill_capacity_tok_s:.0f} tok/s vs TTFT SLO {slos.ttft_p90_ms:.0f} ms"))
            utilisation.append((load.prefill_demand_tok_s / load.prefill_capacity_tok_s,
                                f"prefill demand {load.prefill_demand_tok_s:.0f} tok/s vs capacity "
                                f"{load.prefill_capacity_tok_s:.0f} tok/s"))
        return _worst(latency, utilisation)
    return _worst(
        (load.itl_p90_ms / slos.itl_p90_ms, f"ITL p90 {load.itl_p90_ms:.1f} ms vs SLO {slos.itl_p90_ms:.1f} ms"
                                            + (f" (queue p90 {load.queue_time_p90_ms:.0f} ms)"
                                               if load.queue_time_p90_ms > 0 else "")),
        [(load.decode_occupancy / thresholds.occupancy_target,
          f"decode batch occupancy {load.decode_occupancy:.0%} vs target {thresholds.occupancy_target:.0%}"),
         (load.kv_usage / thresholds.kv_target, f"KV usage {load.kv_usage:.0%} vs target {thresholds.kv_target:.0%}")])


def after_one_fewer(pressure: Pressure, count: int) -> float:
    """The role's pressure once one of `count` workers leaves (inf if none would be left).

    Utilisation terms grow with the load per worker: x count / (count - 1). A latency is part
    fixed cost (a decode step's base time, a prompt's own compute) and part load: only the
    load's share grows, and that share is taken as the role's utilisation (capped at 1). An
    idle decode role's ITL is its step time, which one worker fewer does not change; a full
    one's grows with the sequences per worker. With no utilisation known, the whole latency
    is scaled (the cautious reading)."""
    if count <= 1:
        return float("inf")
    growth = count / (count - 1)
    if pressure.utilisation is None:
        return pressure.value * growth
    share = min(1.0, max(0.0, pressure.utilisation))
    return max(pressure.latency * (1.0 + share * (growth - 1.0)), pressure.utilisation * growth)


def track(trend: Trend | None, value: float, *, enter: float, exit: float, hot: bool, now: float) -> Trend:
    """The trend after one sample. Hot: enters above `enter`, leaves below `exit` (exit < enter);
    cold: enters below `enter`, leaves above `exit` (exit > enter)."""
    trend = trend or Trend()
    beyond_enter = value > enter if hot else value < enter
    beyond_exit = value < exit if hot else value > exit
    active = beyond_enter or (trend.active and not beyond_exit)
    held_since = (trend.held_since if trend.held_since is not None else now) if beyond_enter else None
    return Trend(active=active, held_since=held_since)


def sustained(trend: Trend, now: float, sustain_s: float) -> bool:
    return trend.active and trend.held_since is not None and now - trend.held_since >= sustain_s
