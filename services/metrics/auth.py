"""The collector's pages behind API keys (ASGI middleware), when `MetricsConfig.api_keys_file`
names a key file (the router's format, `shared.api_keys`; reloaded when it changes).

Guarded: the cluster page and its assets, `/` and the `/cluster` JSON; `/metrics` only
with `metrics_auth = "api-key"`; `/health` stays open for probes. A key comes as
`Authorization: Bearer <key>`, or as HTTP Basic with the key as password: a 401 carries
both challenges, so a browser opening the cluster page asks for it (any user name) and
sends it again on the page's own requests. No per-key limits here: these are a few
people's pages, not the serving API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.metrics.config import MetricsConfig
from shared.api_keys import KeyFileError, presented_key
from shared.api_keys_file import KeyFileWatcher
from shared.config import ConfigError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
CHALLENGES = [(b"www-authenticate", b'Basic realm="tandem metrics", charset="UTF-8"'),
              (b"www-authenticate", b'Bearer realm="tandem metrics"')]


class CollectorAuth:
    def __init__(self, app: ASGIApp, watcher: KeyFileWatcher, clock: Callable[[], float], *,
                 guard_metrics: bool) -> None:
        self.app = app
        self.watcher = watcher
        self.clock = clock
        self.open_paths = OPEN_PATHS if guard_metrics else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                              if name == b"authorization"), None)
        presented = presented_key(authorization, basic=True)
        if presented is not None and self.watcher.table(self.clock()).lookup(presented) is not None:
            await self.app(scope, receive, send)
            return
        code = "missing_key" if presented is None else "invalid_key"
        response = JSONResponse({"error": {"message": "An API key is needed: `Authorization: Bearer <key>`.",
                                           "type": "authentication_error", "param": None, "code": code}},
                                status_code=401)
        response.raw_headers.extend(CHALLENGES)
        await response(scope, receive, send)


def guard_pages(app: FastAPI, config: MetricsConfig) -> None:
    """Put the collector's pages behind `config.api_keys_file`, if one is named (read now:
    a bad file fails the start)."""
    if not config.api_keys_file:
        return
    try:
        watcher = KeyFileWatcher(config.api_keys_file)
    except KeyFileError as error:
        raise ConfigError(str(error)) from None
    app.add_middleware(CollectorAuth, watcher=watcher, clock=time.monotonic,
                       guard_metrics=config.metrics_auth == "api-key")
    log.info("cluster pages guarded by the API keys in %s; /metrics %s", config.api_keys_file,
             "too" if config.metrics_auth == "api-key" else "open")
