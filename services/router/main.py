"""Runs the router: uvicorn serving `create_app(config)`.

Port 0 picks a free port. Once the app's lifespan has started and the socket listens,
one line `tandem-router listening on http://HOST:PORT` goes to stderr, for people; launchers
check readiness through the health endpoints instead.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable

import uvicorn

from services.router.app import create_app
from services.router.event_loop import event_loop_factory
from shared.bus import connect
from shared.config import RouterConfig
from shared.tracing import setup_tracing

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to finish when the router stops


def announce(url: str) -> None:
    print(f"tandem-router listening on {url}", file=sys.stderr, flush=True)


class RouterServer(uvicorn.Server):
    """A uvicorn server that knows the URL it actually bound (port 0 included)."""

    def __init__(self, config: RouterConfig, *, on_listening: Callable[[str], None] | None = None) -> None:
        # No access log: request outcomes are in the metrics and the request records.
        super().__init__(uvicorn.Config(create_app(config), host=config.host, port=config.port, lifespan="on",
                                        access_log=False, log_config=None,
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self.url = ""
        self.listening = asyncio.Event()
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.listening.set()
        if self._on_listening is not None:
            self._on_listening(self.url)


async def serve_router(config: RouterConfig) -> None:
    config.validate()
    setup_tracing("tandem-router", config.tracing.exporter, config.tracing.otlp_endpoint)
    # NATS refusing the router (credentials, TLS) is a one-line error before the app starts
    await (await connect(config.bus, "tandem-router-check")).close()
    await RouterServer(config, on_listening=announce).serve()


def run_router(config: RouterConfig) -> None:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop where installed
        runner.run(serve_router(config))
