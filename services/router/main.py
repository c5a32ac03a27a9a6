"""Runs the router: uvicorn serving `create_app(config)`.

Port 0 picks a free port. Once the app's lifespan has started and the socket listens,
one line `tandem-router listening on http://HOST:PORT` goes to stderr, for people; launchers
check readiness through the health endpoints instead.

Replicas: with `reuse_port`, several routers bind the same port (`SO_REUSEPORT`, Linux)
and the kernel spreads new connections over them; each shares its predicted load with the
others over NATS (`shared_load_link`). The router binds its sockets itself and listens only
once its lifespan has started, so no connection waits on a router that cannot serve yet.
As the shared port cannot name one router, `instance_port` adds a second socket that is this
router's alone (health checks, metrics of one replica).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from collections.abc import Callable

import uvicorn

from services.router.config import RouterConfig
from services.router.event_loop import event_loop_factory
from services.router.http.app import create_app
from shared.bus import connect
from shared.config import ConfigError
from shared.tracing import setup_tracing

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to finish when the router stops


def announce(url: str) -> None:
    print(f"tandem-router listening on {url}", file=sys.stderr, flush=True)


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound, not yet listening (the server listens once it can serve)."""
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("routers sharing a port need SO_REUSEPORT, which this platform lacks")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as error:  # the port is taken (by a router that does not share it, or another program)
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port}: {error.strerror or error}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RouterServer(uvicorn.Server):
    """A uvicorn server that knows the URLs it actually bound (port 0 included): `url`, the
    router's address (shared by replicas with `reuse_port`), and `instance_url`, this
    router's alone when `instance_port` is set (else the same as `url`)."""

    def __init__(self, config: RouterConfig, *, on_listening: Callable[[str], None] | None = None) -> None:
        # No access log: request outcomes are in the metrics and the request records.
        super().__init__(uvicorn.Config(create_app(config), host=config.host, port=config.port, lifespan="on",
                                        access_log=False, log_config=None,
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self.url = ""
        self.instance_url = ""
        self.listening = asyncio.Event()
        self._on_listening = on_listening
        self._router_config = config

    def bind(self) -> list[socket.socket]:
        """The router's sockets: its address, then its own (`instance_port`), if any."""
        config = self._router_config
        sockets = [bind_socket(config.host, config.port, reuse_port=config.reuse_port)]
        if config.instance_port is not None:
            try:
                sockets.append(bind_socket(config.host, config.instance_port))
            except BaseException:
                sockets[0].close()
                raise
        return sockets

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets if sockets is not None else self.bind())

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        listening = [server_socket for server in self.servers for server_socket in server.sockets]
        self.url = _url(listening[0])
        self.instance_url = _url(listening[-1])
        self.listening.set()
        if self._on_listening is not None:
            self._on_listening(self.url if self.instance_url == self.url else f"{self.url} (this router alone: "
                                                                              f"{self.instance_url})")


# The router allocates a few hundred objects per request: with the interpreter's default
# (a young-generation collection every 700 allocations) one routing decision in ~20 paid a
# collection (0.3-0.5 ms of CPU on this box, as much as the decision itself). Collections
# every 20,000 allocations touch one request in several hundred.
GC_YOUNG_THRESHOLD = 20_000


async def serve_router(config: RouterConfig) -> None:
    config.validate()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    setup_tracing("tandem-router", config.tracing.exporter, config.tracing.otlp_endpoint)
    # NATS refusing the router (credentials, TLS) is a one-line error before the app starts
    await (await connect(config.bus, "tandem-router-check")).close()
    await RouterServer(config, on_listening=announce).serve()


def run_router(config: RouterConfig) -> None:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # uvloop where installed
        runner.run(serve_router(config))
