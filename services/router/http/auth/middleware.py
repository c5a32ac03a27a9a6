"""The router's API key check as ASGI middleware (the adapter over `decision` and `limits`).

`create_app` installs `ApiKeyMiddleware` inside the tracing middleware (so the request's
span is current and a refusal is traced too) and outside the input guard (so a request
without a valid key is refused before its body is read). What it guards:
- `/v1/*`, `/tokenize` and `/detokenize`: a valid key within its limits; the key's name goes
  on the span (`tandem.api_key`) and into `tandem_router_api_key_requests{key, outcome}`
  (vLLM's server leaves its tokenizer routes open; here the whole API needs a key);
- `/metrics`: a valid key when `metrics_auth` is `api-key` (no limits), else open;
- everything else (`/health`, `/ready`): open, for probes.
The concurrency slot a request holds is released once its answer, streamed or not, ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.config import RouterConfig
from services.router.flows.spans import name_api_key
from services.router.http.auth.decision import Denial, Granted, authenticate, authorize
from services.router.http.auth.limits import KeyLimiter, Outcome
from services.router.http.caller import API_KEY_SCOPE
from services.router.metrics import RouterMetrics
from services.router.openai.errors import error_response, error_type
from services.router.openai.protocol_answers import ErrorInfo
from shared.api_keys import KeyFileError
from shared.api_keys_file import KeyFileWatcher
from shared.config import ConfigError

log = logging.getLogger(__name__)

API_PREFIX = "/v1/"
API_PATHS = frozenset({"/tokenize", "/detokenize"})  # the API's routes outside /v1 (vLLM's paths)
METRICS_PATH = "/metrics"


class ApiKeyGate:
    """What the middleware needs between requests: the watched key file, the limits' state,
    the clock and the metrics."""

    def __init__(self, watcher: KeyFileWatcher, metrics: RouterMetrics, clock: Callable[[], float], *,
                 guard_metrics: bool) -> None:
        self.watcher = watcher
        self.metrics = metrics
        self.clock = clock
        self.guard_metrics = guard_metrics
        self.limiter = KeyLimiter()


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, gate: ApiKeyGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        gate = self.gate
        if path.startswith(API_PREFIX) or path in API_PATHS:
            now = gate.clock()
            verdict = authorize(gate.watcher.table(now), gate.limiter, _authorization(scope), now)
        elif path == METRICS_PATH and gate.guard_metrics:
            key = authenticate(gate.watcher.table(gate.clock()), _authorization(scope))
            if isinstance(key, Denial):
                await self._refuse(key, scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        else:
            await self.app(scope, receive, send)
            return
        if isinstance(verdict, Denial):
            await self._refuse(verdict, scope, receive, send)
            return
        assert isinstance(verdict, Granted)
        name = verdict.key.name
        name_api_key(name)
        scope[API_KEY_SCOPE] = verdict.key  # its priority, weight and token budget (`http.caller`)
        gate.metrics.count_api_key(name, Outcome.ACCEPTED.value)
        try:
            await self.app(scope, receive, send)
        finally:
            gate.limiter.release(name)

    async def _refuse(self, denial: Denial, scope: Scope, receive: Receive, send: Send) -> None:
        if denial.key_name:
            name_api_key(denial.key_name)
            self.gate.metrics.count_api_key(denial.key_name, denial.code)
        else:
            self.gate.metrics.count_auth_rejected(denial.code)
        info = ErrorInfo(message=denial.message, type=_error_type(denial.status), code=denial.code)
        await error_response(denial.status, info, denial.headers)(scope, receive, send)


def _error_type(status: int) -> str:
    return "authentication_error" if status == 401 else error_type(status)


def install_api_keys(app: FastAPI, config: RouterConfig, metrics: RouterMetrics, clock: Callable[[], float]) -> None:
    """Guard `app` with `config.api_keys_file` (read now: a bad file fails the start), or
    warn once that the API is open."""
    if not config.api_keys_file:
        log.warning("the router's API is OPEN: no API key file (--api-keys-file or TANDEM_API_KEYS_FILE); "
                    "anyone who can reach %s:%s can use it", config.host, config.port)
        return
    try:
        watcher = KeyFileWatcher(config.api_keys_file)
    except KeyFileError as error:
        raise ConfigError(str(error)) from None
    table = watcher.table(clock())
    log.info("router API guarded by the API keys in %s (%d: %s); /metrics %s", config.api_keys_file, len(table),
             ", ".join(table.names) or "none yet", "needs a key" if config.metrics_auth == "api-key" else "open")
    app.add_middleware(ApiKeyMiddleware,
                       gate=ApiKeyGate(watcher, metrics, clock, guard_metrics=config.metrics_auth == "api-key"))
