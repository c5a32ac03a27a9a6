"""Wiring for the metrics collector process: bus, cluster view, HTTP, until stopped.

The CLI / launcher builds a `MetricsConfig` and awaits `run_metrics`. Once the HTTP
socket is bound it prints `tandem-metrics listening on http://HOST:PORT` to stderr
for people, then the live cluster page's URL; launchers check readiness through `/metrics`.
"""

from __future__ import annotations

import asyncio
import sys

from services.metrics.auth import guard_pages
from services.metrics.cluster_page import PAGE_PATH
from services.metrics.config import MetricsConfig
from services.metrics.http_api import HttpServer, build_app
from services.metrics.service import MetricsService
from shared.bus import connect
from shared.lifecycle import serve_until_signalled


async def run_metrics(config: MetricsConfig, *, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled or SIGTERM; `ready` is set once subscribed and serving HTTP."""
    config.validate()
    bus = await connect(config.bus, "tandem-metrics")
    service = MetricsService(config, bus)
    app = build_app(service.view, service.registry, lambda: service.bus_connected, service.clock)
    guard_pages(app, config)
    http = HttpServer(app, config.host, config.port)
    try:
        await service.start()
        await http.start()
        print(f"tandem-metrics listening on {http.url}", file=sys.stderr, flush=True)
        print(f"tandem-metrics cluster page: {http.url}{PAGE_PATH}", file=sys.stderr, flush=True)
        await serve_until_signalled(ready)
    finally:
        await http.stop()
        await service.stop()
        await bus.close()
