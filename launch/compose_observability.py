"""The compose file's `observability` profile (`launch.compose`): an OpenTelemetry
collector receiving the services' OTLP traces (TANDEM_TRACE_EXPORTER=otlp) and sending them
to Jaeger, Prometheus scraping the router and the metrics collector, Grafana with
provisioned data sources and dashboards. Official images; their configuration lives in
`observability/`, mounted read-only:

  observability/otel-collector.yaml            -> otel-collector /etc/otelcol/config.yaml
  observability/prometheus/prometheus.yml      -> prometheus /etc/prometheus/prometheus.yml
  observability/grafana/provisioning/          -> grafana /etc/grafana/provisioning (datasources/, dashboards/)
  observability/grafana/dashboards/            -> grafana /var/lib/grafana/dashboards

Inside the compose network the services are reachable by name: router:8000,
metrics:9100, otel-collector:4317 (gRPC) / :4318 (HTTP), jaeger:4317, prometheus:9090.
"""

from __future__ import annotations

PROFILE = "observability"
OTLP_TRACES_ENDPOINT = "${OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:-http://otel-collector:4318/v1/traces}"


def observability_services() -> dict[str, object]:
    common = {"profiles": [PROFILE], "restart": "unless-stopped"}
    return {
        "otel-collector": {
            "image": "${OTEL_COLLECTOR_IMAGE:-otel/opentelemetry-collector-contrib:0.111.0}",
            "command": ["--config=/etc/otelcol/config.yaml"],
            "volumes": ["../observability/otel-collector.yaml:/etc/otelcol/config.yaml:ro"],
            "depends_on": ["jaeger"],
            **common,
        },
        "jaeger": {
            "image": "${JAEGER_IMAGE:-jaegertracing/all-in-one:1.62.0}",
            "environment": {"COLLECTOR_OTLP_ENABLED": "true"},
            "ports": ["${JAEGER_PORT:-16686}:16686"],
            **common,
        },
        "prometheus": {
            "image": "${PROMETHEUS_IMAGE:-prom/prometheus:v2.55.0}",
            "command": ["--config.file=/etc/prometheus/prometheus.yml", "--enable-feature=exemplar-storage",
                        "--web.enable-lifecycle"],
            "volumes": ["../observability/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"],
            "ports": ["${PROMETHEUS_PORT:-9090}:9090"],
            **common,
        },
        "grafana": {
            "image": "${GRAFANA_IMAGE:-grafana/grafana:11.3.0}",
            "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                            "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": "/var/lib/grafana/dashboards/overview.json"},
            "volumes": ["../observability/grafana/provisioning:/etc/grafana/provisioning:ro",
                        "../observability/grafana/dashboards:/var/lib/grafana/dashboards:ro"],
            "ports": ["${GRAFANA_PORT:-3000}:3000"],
            "depends_on": ["prometheus", "jaeger"],
            **common,
        },
    }
