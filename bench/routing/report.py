"""The sweep's verdicts and summary (pure): from result rows to what the JSON document and
the progress table say.

Per point, three checks of kv-aware routing, each `{..., "pass": bool | None}` (None: an arm
it needs did not run or has no figure):
- `p99_vs_plain`: kv-aware P99 TTFT <= round-robin-plain's (no worse than the plain baseline);
- `p90_vs_oracle`: kv-aware P90 TTFT / the oracle's <= `P90_ORACLE_LIMIT`;
- `cached_share_vs_oracle`: where the shared prefixes fit in the cluster's cache
  (kv_pressure <= 1), |kv-aware cached share - the oracle's| / the oracle's <= `SHARE_GAP_LIMIT`
  (cached share counts local hits and pulled tokens alike; the rows split them).
- `gain_vs_dynamo` (when Dynamo's arms ran): kv-aware's P90 gain over round-robin-plain >=
  Dynamo's KV router's gain over its own round-robin (each router against its own plain
  baseline on its own engines; absolute figures of the two systems are not compared).
With the `oracle-learned` arm (the oracle learning the shares first), `p90_vs_learned_oracle`
gives kv-aware's P90 over that arm's, for reference: not a check, no `pass`, not in the
point's outcome.
`gains` gives each arm's P90 gain over its own system's plain baseline (`Arm.baseline`).
With repeated runs of a point (`--repeats`), `over_repeats` holds each check's figure per run
(a ratio of two arms run side by side in that repeat) and judges its median; `median_gains`
gives each arm's median gain. Called by `bench.routing.sweep`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from bench.routing.family import SweepPoint

P90_ORACLE_LIMIT = 1.3
SHARE_GAP_LIMIT = 0.10


def _figure(row: Mapping | None, name: str) -> float | None:
    if row is None or row.get("error"):
        return None
    value = row.get(name)
    return float(value) if value is not None else None


def verdict(point: SweepPoint, rows: Mapping[str, Mapping]) -> dict:
    """The checks of one point from its rows by arm name."""
    kv, plain, oracle = rows.get("kv-aware"), rows.get("round-robin-plain"), rows.get("oracle")
    kv_p99, plain_p99 = _figure(kv, "ttft_p99_ms"), _figure(plain, "ttft_p99_ms")
    p99 = {"kv_aware_ms": kv_p99, "plain_ms": plain_p99,
           "pass": None if kv_p99 is None or plain_p99 is None else kv_p99 <= plain_p99}
    kv_p90, oracle_p90 = _figure(kv, "ttft_p90_ms"), _figure(oracle, "ttft_p90_ms")
    ratio = round(kv_p90 / oracle_p90, 3) if kv_p90 is not None and oracle_p90 else None
    p90 = {"ratio": ratio, "limit": P90_ORACLE_LIMIT, "pass": None if ratio is None else ratio <= P90_ORACLE_LIMIT}
    checks = {"p99_vs_plain": p99, "p90_vs_oracle": p90}
    if point.kv_pressure <= 1:
        kv_share, oracle_share = _figure(kv, "cached_share"), _figure(oracle, "cached_share")
        gap = (round(abs(kv_share - oracle_share) / oracle_share, 3)
               if kv_share is not None and oracle_share else None)
        checks["cached_share_vs_oracle"] = {"kv_aware": kv_share, "oracle": oracle_share, "relative_gap": gap,
                                            "limit": SHARE_GAP_LIMIT,
                                            "pass": None if gap is None else gap <= SHARE_GAP_LIMIT}
    if "dynamo-kv" in rows or "dynamo-round-robin" in rows:
        tandem = _gain(kv, plain)
        dynamo = _gain(rows.get("dynamo-kv"), rows.get("dynamo-round-robin"))
        checks["gain_vs_dynamo"] = {"tandem_gain": tandem, "dynamo_gain": dynamo,
                                    "pass": None if tandem is None or dynamo is None else tandem >= dynamo}
    outcomes = [check["pass"] for check in checks.values()]
    checks["pass"] = None if None in outcomes else all(outcomes)
    if "kv-tier-blind" in rows:
        checks["tiers_vs_blind"] = tier_check(kv, rows["kv-tier-blind"])
    learned_p90 = _figure(rows.get("oracle-learned"), "ttft_p90_ms")
    if kv_p90 is not None and learned_p90:
        checks["p90_vs_learned_oracle"] = {"ratio": round(kv_p90 / learned_p90, 3)}
    return checks


def tier_check(aware: Mapping | None, blind: Mapping | None) -> dict:
    """Tier-aware routing (kv-aware) against tier-blind on the same tiered workers: it passes
    with a higher cached share and a lower P90 TTFT."""
    aware_share, blind_share = _figure(aware, "cached_share"), _figure(blind, "cached_share")
    aware_p90, blind_p90 = _figure(aware, "ttft_p90_ms"), _figure(blind, "ttft_p90_ms")
    known = None not in (aware_share, blind_share, aware_p90, blind_p90)
    return {"aware_cached_share": aware_share, "blind_cached_share": blind_share, "aware_p90_ms": aware_p90,
            "blind_p90_ms": blind_p90, "p90_ratio": _ratio(aware_p90, blind_p90),
            "pass": (aware_share > blind_share and aware_p90 < blind_p90) if known else None}


def _gain(arm: Mapping | None, baseline: Mapping | None) -> float | None:
    own, base = _figure(arm, "ttft_p90_ms"), _figure(baseline, "ttft_p90_ms")
    return round(base / own, 3) if own and base is not None else None


def gains(rows: Mapping[str, Mapping], baselines: Mapping[str, str]) -> dict[str, float | None]:
    """Each arm's P90 TTFT gain over its baseline arm (baseline P90 / arm P90; above 1 is better)."""
    result: dict[str, float | None] = {}
    for arm, baseline in baselines.items():
        if arm not in rows or not baseline:
            continue
        result[arm] = _gain(rows[arm], rows.get(baseline))
    return result


# per check: its figure in one run's verdict, and whether a figure passes
_REPEATED_CHECKS: dict[str, tuple[Callable[[Mapping], float | None], Callable[[float, Mapping], bool]]] = {
    "p99_vs_plain": (lambda check: _ratio(check["kv_aware_ms"], check["plain_ms"]),
                     lambda value, check: value <= 1.0),
    "p90_vs_oracle": (lambda check: check["ratio"], lambda value, check: value <= check["limit"]),
    "cached_share_vs_oracle": (lambda check: check["relative_gap"], lambda value, check: value <= check["limit"]),
    "gain_vs_dynamo": (lambda check: _ratio(check["tandem_gain"], check["dynamo_gain"]),
                       lambda value, check: value >= 1.0),
    "tiers_vs_blind": (lambda check: check["p90_ratio"], lambda value, check: value < 1.0),
}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


def _spread(values: Sequence[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def over_repeats(runs: Sequence[Mapping]) -> dict:
    """One point's checks over its repeated runs (each a `verdict`): per check, its figure in
    each run (`p99_vs_plain`: kv-aware P99 / plain's; `p90_vs_oracle`: the ratio;
    `cached_share_vs_oracle`: the relative gap; `gain_vs_dynamo`: Tandem's gain / Dynamo's),
    their median and spread, how many runs passed, and a pass judged on the median (None
    where a run lacks the figure). The learned oracle's ratio: its median and spread only."""
    if not runs:
        return {"pass": None, "repeats": 0}
    checks: dict[str, dict] = {}
    for name, (figure, passes) in _REPEATED_CHECKS.items():
        if not all(name in run for run in runs):
            continue
        values = [figure(run[name]) for run in runs]
        check = {"per_repeat": values, "passed_repeats": sum(run[name]["pass"] is True for run in runs)}
        if None in values:
            check["pass"] = None
        else:
            check |= _spread(values)
            check["pass"] = passes(check["median"], runs[0][name])
        if "limit" in runs[0][name]:
            check["limit"] = runs[0][name]["limit"]
        checks[name] = check
    outcomes = [check["pass"] for check in checks.values()]
    checks["pass"] = None if None in outcomes else all(outcomes)
    if all("p90_vs_learned_oracle" in run for run in runs):
        ratios = [run["p90_vs_learned_oracle"]["ratio"] for run in runs]
        checks["p90_vs_learned_oracle"] = {"per_repeat": ratios, **_spread(ratios)}
    checks["repeats"] = len(runs)
    return checks


def median_gains(runs: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Each arm's median P90 gain over its repeated runs (`gains` of each); None where a run has none."""
    result: dict[str, float | None] = {}
    for arm in runs[0] if runs else {}:
        values = [run.get(arm) for run in runs]
        result[arm] = None if None in values else round(statistics.median(values), 3)
    return result


SUMMARY_FIELDS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "cached_share", "local_share", "pulled_share",
                  "evicted_blocks", "evicted_missed_blocks", "computed_imbalance", "errors")


def summary(rows: list[Mapping]) -> list[dict]:
    """One short line per row: the figures a reader compares first."""
    return [{"point": row["point"], "arm": row["arm"],
             **({"error": row["error"]} if row.get("error") else {name: row.get(name) for name in SUMMARY_FIELDS})}
            for row in rows]


def table(rows: list[Mapping]) -> str:
    """`summary` as aligned text, for the progress stream."""
    header = ("point", "arm", "p50", "p90", "p99", "cached", "local", "pulled", "evicted", "ev.missed", "imbal",
              "errors")
    lines = [header]
    for line in summary(rows):
        if "error" in line:
            lines.append((line["point"], line["arm"], "error: " + str(line["error"])[:60]))
            continue
        lines.append((line["point"], line["arm"], *("-" if line[name] is None else str(line[name])
                                                    for name in SUMMARY_FIELDS)))
    widths = [max(len(line[index]) for line in lines if index < len(line)) for index in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
