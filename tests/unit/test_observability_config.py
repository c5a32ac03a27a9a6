"""The files in `observability/` are what Grafana, Prometheus and the OTel collector accept:
dashboards are valid Grafana JSON whose panels all query the provisioned Prometheus data
source, provisioning points at the dashboards, the scrape config names the compose
services, and the collector receives OTLP and exports to Jaeger and its log."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.grafana_dashboards import (
    DASHBOARDS,
    OBSERVABILITY,
    PROVISIONING,
    all_panels,
    dashboard_files,
    dashboard_variables,
    grafana_expr,
    load_dashboard,
    local_prometheus_config,
    panel_queries,
    prometheus_config,
)

EXPECTED_DASHBOARDS = {"overview.json", "routing.json", "kv-transfers.json", "workers.json"}
METRIC_NAME = re.compile(r"\btandem_[a-z0-9_]+")


def datasources() -> list[dict]:
    found = []
    for path in sorted((PROVISIONING / "datasources").glob("*.yaml")):
        found.extend(yaml.safe_load(path.read_text())["datasources"])
    return found


def test_the_four_dashboards_exist() -> None:
    assert {path.name for path in dashboard_files()} == EXPECTED_DASHBOARDS


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda path: path.name)
def test_a_dashboard_is_valid_grafana_json(path: Path) -> None:
    dashboard = load_dashboard(path)
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    prometheus_uids = {source["uid"] for source in datasources() if source["type"] == "prometheus"}
    panels = all_panels(dashboard)
    assert panels, "a dashboard without panels"
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    for panel in panels:
        assert panel["title"] and panel["type"] in {"timeseries", "stat", "gauge", "table", "bargauge"}
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        assert panel["datasource"]["type"] == "prometheus" and panel["datasource"]["uid"] in prometheus_uids
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{panel['title']}: refIds repeat"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]
    uids = [load_dashboard(other)["uid"] for other in dashboard_files()]
    assert len(uids) == len(set(uids))


def test_every_query_names_tandem_metrics_and_known_variables() -> None:
    variables = dashboard_variables()
    for query in panel_queries():
        assert METRIC_NAME.search(query.expr), query
        grafana_expr(query.expr, variables[query.dashboard])  # every variable is defined: no KeyError


def test_grafana_substitutes_intervals_and_all_values() -> None:
    assert grafana_expr('rate(x{role=~"$role"}[$__rate_interval])', {"role": ".*"}) == 'rate(x{role=~".*"}[1m])'
    assert grafana_expr("x{a=~\"${role}\"}[$__interval]", {"role": "decode"}) == 'x{a=~"decode"}[15s]'
    with pytest.raises(KeyError):
        grafana_expr("x{a=~\"$nobody\"}", {})


def test_metric_names_carry_units_or_totals() -> None:
    """Names end in a unit or a count's suffix (`_total` after the exposition adds it)."""
    suffixes = ("_total", "_seconds", "_bytes", "_tokens", "_ratio", "_rate", "_requests", "_blocks", "_leases",
                "_workers", "_synced", "_bucket", "_count", "_sum")
    for query in panel_queries():
        for name in METRIC_NAME.findall(query.expr):
            assert name.endswith(suffixes), f"{name} in {query.dashboard} names no unit"


def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    providers = [provider for path in sorted((PROVISIONING / "dashboards").glob("*.yaml"))
                 for provider in yaml.safe_load(path.read_text())["providers"]]
    assert providers and all(provider["type"] == "file" for provider in providers)
    assert {provider["options"]["path"] for provider in providers} == {"/var/lib/grafana/dashboards"}
    assert DASHBOARDS.name == "dashboards" and DASHBOARDS.parent.name == "grafana"
    [prometheus] = [source for source in datasources() if source["type"] == "prometheus"]
    assert prometheus["uid"] == "prometheus" and prometheus["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_the_router_and_the_collector() -> None:
    config = prometheus_config()
    targets = {job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
               for job in config["scrape_configs"]}
    assert targets == {"tandem-router": ["router:8000"], "tandem-metrics": ["metrics:9100"]}
    local = local_prometheus_config({"router": "127.0.0.1:1", "metrics": "127.0.0.1:2"})
    assert [static["targets"] for job in local["scrape_configs"] for static in job["static_configs"]] == \
        [["127.0.0.1:1"], ["127.0.0.1:2"]]
    assert local["global"]["scrape_interval"] == "1s"


def test_prometheus_accepts_its_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install -y prometheus)")
    result = subprocess.run([promtool, "check", "config", str(OBSERVABILITY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_otel_collector_receives_otlp_and_exports_to_jaeger_and_its_log() -> None:
    config = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317") and protocols["http"]["endpoint"].endswith(":4318")
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert "debug" in config["exporters"]
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and set(traces["exporters"]) == {"otlp/jaeger", "debug"}
    for processor in traces.get("processors", []):
        assert processor in config["processors"]
