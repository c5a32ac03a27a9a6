"""The Grafana dashboards and Prometheus config in `observability/`, read the way Grafana and
Prometheus read them, for the tests that check them (`tests/unit/test_observability_config.py`,
`tests/e2e/test_dashboards_prometheus.py`).

`panel_queries()` lists every PromQL expression of every panel of every dashboard;
`grafana_expr()` substitutes Grafana's variables the way Grafana does before it sends an
expression to Prometheus (`$__rate_interval` -> a range, a template variable set to "All"
-> its `allValue`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

OBSERVABILITY = Path(__file__).resolve().parent.parent / "observability"
DASHBOARDS = OBSERVABILITY / "grafana" / "dashboards"
PROVISIONING = OBSERVABILITY / "grafana" / "provisioning"
PROMETHEUS_CONFIG = OBSERVABILITY / "prometheus" / "prometheus.yml"

# What Grafana puts in place of its built-in interval variables for a short time range.
BUILTIN_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m", "__interval_ms": "15000",
                     "__range_s": "300"}
_LABEL_VALUES = re.compile(r"label_values\((\w+),\s*(\w+)\)")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # file name
    panel: str  # title
    ref_id: str
    expr: str  # as written in the dashboard


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Panels, including those nested in rows."""
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [panel for panel in panels if panel.get("type") != "row"]


def panel_queries() -> list[PanelQuery]:
    queries = []
    for path in dashboard_files():
        for panel in all_panels(load_dashboard(path)):
            for target in panel.get("targets", []):
                queries.append(PanelQuery(path.name, panel.get("title", ""), target.get("refId", ""),
                                          target.get("expr", "")))
    return queries


def all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each template variable's value when "All" is selected: its `allValue` (Grafana's own
    default for a regex matcher is every value, `.*`)."""
    return {variable["name"]: variable.get("allValue") or ".*"
            for variable in dashboard.get("templating", {}).get("list", [])}


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    """`expr` as Grafana sends it to Prometheus; an unknown variable raises KeyError."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTIN_INTERVALS:
            return BUILTIN_INTERVALS[name]
        return variables[name]

    return _VARIABLE.sub(value, expr)


def dashboard_variables() -> dict[str, dict[str, str]]:
    """Per dashboard file name: its variables' "All" values."""
    return {path.name: all_values(load_dashboard(path)) for path in dashboard_files()}


def variable_lookups() -> list[tuple[str, str, str]]:
    """(dashboard file, metric, label) of each `label_values(metric, label)` query variable."""
    lookups = []
    for path in dashboard_files():
        for variable in load_dashboard(path).get("templating", {}).get("list", []):
            match = _LABEL_VALUES.fullmatch(variable.get("definition", ""))
            if variable.get("type") == "query" and match:
                lookups.append((path.name, match.group(1), match.group(2)))
    return lookups


def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def local_prometheus_config(targets: dict[str, str], scrape_interval: str = "1s") -> dict[str, Any]:
    """The committed config with each target `service:port` replaced by `targets[service]`
    (a `host:port`), and a short scrape interval; a target naming no known service raises KeyError."""
    config = prometheus_config()
    config.setdefault("global", {}).update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    for job in config["scrape_configs"]:
        job["scrape_interval"] = scrape_interval
        for static in job.get("static_configs", []):
            static["targets"] = [targets[target.split(":")[0]] for target in static["targets"]]
    return config
