"""The collector's HTTP surface: `/metrics` (Prometheus), `/cluster` (JSON: the view's
`ClusterStatus` at the time of the request), `/health`, and the live cluster page at
`/cluster/page` (`/` redirects there; `services.metrics.cluster_page`).

`HttpServer` runs uvicorn inside the service's event loop on a socket bound up front, so
port 0 works, the bound port is known before serving, and a busy port is an `OSError`
at start rather than a `sys.exit` inside a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import msgspec
import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from services.metrics.cluster_page import page_router
from services.metrics.cluster_view import ClusterView
from services.metrics.exposition import render


def build_app(view: ClusterView, registry: CollectorRegistry,
              bus_connected: Callable[[], bool], clock: Callable[[], float] = time.time) -> FastAPI:
    app = FastAPI(title="tandem-metrics", docs_url=None, redoc_url=None, openapi_url=None)
    # Handlers are coroutines: they read the cluster view on the event loop that updates it
    # (a plain `def` would run in a thread pool, racing the updates: KeyErrors under churn)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = render(registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/cluster")
    async def cluster() -> Response:
        return Response(msgspec.json.encode(view.status(clock())), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health() -> Response:
        connected = bus_connected()
        body = msgspec.json.encode({"status": "ok" if connected else "nats_disconnected"})
        return Response(body, status_code=200 if connected else 503, media_type="application/json")

    app.include_router(page_router())
    return app


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The service owns SIGTERM; uvicorn would otherwise swallow it and re-raise it
        # after shutting down only the HTTP server.
        yield


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._app = app
        self._host = host
        self._port = port
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None  # the bound port, once started

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.create_server((self._host, self._port), family=family)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_config=None, access_log=False, lifespan="off")
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-http")

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        self._server = self._task = None
