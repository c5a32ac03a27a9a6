"""Runs the router: its assembly, and uvicorn serving the app over it (`router_app(config)`).

`RouterAssembly` wires the router's rooms from its config, so that the HTTP room
(`http.app.create_app`) only serves: the KV view (`kv.view.KvView`) and the prefix
placements (`routing.placement.Placements`), both told of membership by the worker pool
(`fleet.worker_pool.WorkerPool`), which hands the other routers' routed prompts to
`flows.routing_state.RoutedPrompts`; the routing state over them (`RoutingState`), the link to
the workers (`fleet.worker_link.WorkerLink`), the served models (`http.served_models`), the
waker of scalable models (`fleet.model_waker.ModelWaker`), the admission gate, the source
opener and the dispatcher (`flows/`), and the response store. Its `start()` starts them for
the app's lifespan and stops them after it, handing the app what it serves from
(`http.app.Rooms`).

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
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from services.router.config import RouterConfig
from services.router.event_loop import event_loop_factory
from services.router.fleet.model_waker import ModelWaker
from services.router.fleet.worker_link import WorkerLink
from services.router.fleet.worker_pool import WorkerPool
from services.router.flows.admission import AdmissionGate
from services.router.flows.dispatch import Dispatcher
from services.router.flows.executor import FlowExecutor
from services.router.flows.opener import SourceOpener
from services.router.flows.records import Clock, RequestRecorder
from services.router.flows.responses_store import JetStreamResponseStore, MemoryResponseStore, ResponseStore
from services.router.flows.routing_state import RoutedPrompts, RoutingState
from services.router.flows.worker_wait import WorkerWait
from services.router.http.app import Rooms, create_app
from services.router.http.served_models import ServedModel, ServedModels
from services.router.http.serving import ServingContext
from services.router.kv.view import KvView
from services.router.metrics import RouterMetrics
from services.router.routing import build_policy
from services.router.routing.placement.placement import Placements
from shared.bus import Bus, connect
from shared.codec import MalformedCounter
from shared.config import ConfigError
from shared.request_plane import ResponseInbox
from shared.tokenizer import Tokenizer
from shared.tracing import setup_tracing

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to finish when the router stops


class RouterAssembly:
    """The router's rooms, wired from its config (an unknown routing policy fails here, at
    start); `start()` builds and starts them for the app's lifespan."""

    def __init__(self, config: RouterConfig, *, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.policy = build_policy(config.routing)  # an unknown policy name fails here, at start
        self.malformed = MalformedCounter()
        self.metrics = RouterMetrics(self.malformed)

    @asynccontextmanager
    async def start(self) -> AsyncIterator[Rooms]:
        config = self.config
        if not config.model_dir:
            raise ConfigError("the router needs a model directory (for its tokenizer)")
        tokenizer = Tokenizer.from_model_dir(config.model_dir)
        own_model = ServedModel(config.served_model_name or tokenizer.model_name, tokenizer)
        bus = await connect(config.bus, "tandem-router")
        kv_view = KvView(bus, config.bus.subjects, self.malformed, verify_hashes=config.verify_kv_hashes,
                         tier_aware=config.routing.kv_tier_aware)
        placements = Placements(config.routing)  # the prefixes' homes, per model
        prompts = RoutedPrompts(kv_view, placements, routing=config.routing, clock=self.clock)
        pool = WorkerPool(bus, config.bus.subjects, self.malformed,
                          bucket_ttl_s=config.membership.bucket_ttl_s,
                          reconnect_grace_s=config.membership.ttl_s,  # one TTL to re-register after a restart
                          listeners=[kv_view, placements], on_peer_prediction=prompts.peer_routed)
        inbox: ResponseInbox | None = None
        waker: ModelWaker | None = None
        try:
            await kv_view.start()
            await pool.start()
            self.metrics.watch_workers(lambda: len(pool))
            self.metrics.watch_pool(pool.views)
            self.metrics.watch_kv_index(kv_view.stats)
            self.metrics.in_flight.set_function(lambda: pool.in_flight)
            inbox = await ResponseInbox(bus).open()  # one subscription for every generate stream's frames
            scalable = config.scale_from_zero.directories()
            catalog = ServedModels(own_model, pool, scalable)
            catalog.load_scalable()
            if scalable:  # a model with no worker gets one through the orchestrator
                waker = ModelWaker(bus, config.bus.subjects, self.malformed, pool,
                                   timeout_s=config.scale_from_zero.hold_s,
                                   view_wait_s=config.scale_from_zero.view_wait_s)
            rooms = Rooms(bus, self._serving(bus, pool, prompts, catalog, inbox, waker),
                          await self._response_store(bus))
            log.info("router serving %s; %d workers known", ", ".join(catalog.names()), len(pool))
            yield rooms
        finally:
            if waker is not None:
                await waker.stop()
            if inbox is not None:
                await inbox.close()
            await pool.stop()
            await kv_view.stop()
            await bus.close()

    def _serving(self, bus: Bus, pool: WorkerPool, prompts: RoutedPrompts, catalog: ServedModels,
                 inbox: ResponseInbox, waker: ModelWaker | None) -> ServingContext:
        """The request flows over the started rooms: routing, waiting, the flows, admission."""
        config, clock, metrics = self.config, self.clock, self.metrics
        recorder = RequestRecorder(bus=bus, subjects=config.bus.subjects, metrics=metrics, clock=clock)
        # A lease release is a control round trip like an accept: bounded the same way.
        link = WorkerLink(bus, config.bus.subjects, self.malformed, accept_timeout_s=config.accept_timeout_s,
                          idle_timeout_s=config.idle_timeout_s, lease_timeout_s=config.accept_timeout_s, inbox=inbox)
        state = RoutingState(pool, prompts, routing=config.routing, policy=self.policy, metrics=metrics, clock=clock)
        waits = WorkerWait(pool, clock=clock, worker_wait_s=config.worker_wait_s, metrics=metrics,
                           scale_from_zero=config.scale_from_zero, waker=waker)
        opener = SourceOpener(state, waits, FlowExecutor(link, metrics), metrics=metrics, clock=clock,
                              retry_after_s=config.routing.retry_after_s)
        admission = AdmissionGate(config.admission, pool.views, clock, retry_after=config.routing.retry_after_s)
        metrics.admission_waiting.set_function(admission.waiting)
        dispatcher = Dispatcher(opener, admission, decoders=lambda model: catalog.resolved(model).tokenizer,
                                metrics=metrics, recorder=recorder, clock=clock, worker_wait_s=config.worker_wait_s,
                                routing=config.routing, max_attempts=config.max_attempts)
        return ServingContext(config=config, catalog=catalog, pool=pool, dispatcher=dispatcher, recorder=recorder,
                              clock=clock)

    async def _response_store(self, bus: Bus) -> ResponseStore:
        settings = self.config.responses
        if settings.store == "memory":
            return MemoryResponseStore(settings, self.clock)
        return await JetStreamResponseStore.open(bus, self.config.bus.subjects, settings)


def router_app(config: RouterConfig) -> FastAPI:
    """The router's app over its assembly; a config the router cannot start with fails here."""
    return create_app(config, RouterAssembly(config))


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
        super().__init__(uvicorn.Config(router_app(config), host=config.host, port=config.port, lifespan="on",
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
