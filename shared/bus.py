"""NATS connection helpers used by every service.

- `connect()` returns a `Bus`: a connected client with an `error_cb` (without one, every
  reconnect attempt prints a traceback), unlimited reconnects, and hooks run on disconnect
  and on reconnect. `BusConfig.nats_url` may list the servers of a cluster (comma-separated):
  the client connects to one of them and, when it goes, to another; pings find a server
  that went silent (a host gone, not just its process) within `PING_INTERVAL_S` x
  (`MAX_OUTSTANDING_PINGS` + 1). Buckets are created with `BusConfig.replicas` copies. Given a `BusConfig`, it authenticates with the service's credentials
  file and speaks TLS when the config names a CA (handshake first: no credential ever
  crosses a connection that is not encrypted). A server that refuses the credentials, or
  a failed TLS handshake, ends the attempt at once with a `BusConnectError` naming the
  problem, where a server not up yet is waited for.

A key-value bucket mirrored across reconnects is `shared.cluster.bucket_mirror.BucketMirror`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.kv import KeyValue

from shared.config import BusConfig, ConfigError
from shared.nats_auth import inbox_prefix, redact_url
from shared.nats_secrets import read_credentials

log = logging.getLogger(__name__)
# asyncio's TLS transport warns on every connection a server closes; nothing to act on
logging.getLogger("asyncio").addFilter(lambda record: "eof_received" not in record.getMessage())

Hook = Callable[[], Awaitable[None]]

# nats-py's defaults (a ping every 2 minutes) leave a client on a vanished host deaf for
# minutes; a closed socket (a killed server on a live host) is noticed at once regardless.
PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 2
RECONNECT_WAIT_S = 0.2  # between two attempts at the same server; the next server is tried at once


class Bus:
    def __init__(self, client: Client, name: str, *, replicas: int = 1) -> None:
        self.client = client
        self.name = name
        self.replicas = replicas  # copies of each bucket this client creates
        self.js: JetStreamContext = client.jetstream()
        self._reconnect_hooks: list[Hook] = []
        self._disconnect_hooks: list[Callable[[], None]] = []

    def on_reconnect(self, hook: Hook) -> None:
        self._reconnect_hooks.append(hook)

    def on_disconnect(self, hook: Callable[[], None]) -> None:
        """`hook` runs (synchronously) when the connection drops, before any reconnect."""
        self._disconnect_hooks.append(hook)

    def _disconnected(self) -> None:
        log.info("%s disconnected from NATS", self.name)
        for hook in list(self._disconnect_hooks):
            try:
                hook()
            except Exception:
                log.exception("%s: disconnect hook failed", self.name)

    async def _reconnected(self) -> None:
        log.info("%s reconnected to NATS", self.name)
        for hook in list(self._reconnect_hooks):
            try:
                await hook()
            except Exception:  # a failing hook must not stop the others or reconnection
                log.exception("%s: reconnect hook failed", self.name)

    async def key_value(self, bucket: str, *, ttl_s: float | None = None) -> KeyValue:
        """Bind to a bucket, creating it (memory storage, one value per key, `replicas`
        copies) if absent."""
        try:
            return await self.js.key_value(bucket)
        except BucketNotFoundError:
            # direct: any replica answers a read, so reads go on while a new leader is elected
            config = KeyValueConfig(bucket=bucket, history=1, storage=StorageType.MEMORY,
                                    ttl=ttl_s, replicas=self.replicas, direct=True)
            try:
                return await self.js.create_key_value(config)
            except BadRequestError:
                # another client created it first (after a server restart everyone races
                # to re-create it, possibly with another TTL): use theirs
                return await self.js.key_value(bucket)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Drain the connection (what was published is flushed) within 5 s where it is up;
        else, or past that, just close it. Never raises: with the server gone (reconnecting)
        there is nothing to flush, and closing must not keep a stopping service alive."""
        if self.client.is_closed:
            return
        # nats-py's close cancels its reconnect loop, but on Python 3.11 `asyncio.wait_for`
        # can lose that cancel when a refused attempt ends at the same moment; the loop then
        # retries for ever and keeps the event loop, and the stopping service, alive. With
        # attempts capped it ends by itself after one or two more.
        self.client.options["max_reconnect_attempts"] = 1
        if self.client.is_connected:
            try:
                await asyncio.wait_for(self.client.drain(), 5.0)
                return
            except Exception as error:
                log.info("%s: NATS drain failed (%s): closing", self.name, error)
        try:
            await self.client.close()
        except Exception as error:  # its transport may be gone already
            log.info("%s: NATS close: %s", self.name, error)



async def unsubscribe_quietly(subscriptions: Iterable[Subscription | None], owner: str) -> None:
    """Unsubscribe each of `subscriptions` (None: never subscribed) as `owner` stops. One that
    fails has a connection already going away, with nothing left to release: logged (debug),
    never raised, so that the rest of the stop runs."""
    for subscription in subscriptions:
        if subscription is None:
            continue
        try:
            await subscription.unsubscribe()
        except Exception as error:
            log.debug("%s: could not unsubscribe from %s: %s", owner, subscription.subject, error)

class BusConnectError(ConfigError):
    """NATS refused this service (credentials, TLS): retrying would not help."""


def client_ssl_context(config: BusConfig) -> ssl.SSLContext:
    """Verifies the server against the config's CA; shows the client's certificate if any."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca_file)
        if config.tls_cert_file:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file or None)
    except (OSError, ssl.SSLError) as error:
        files = ", ".join(f for f in (config.tls_ca_file, config.tls_cert_file, config.tls_key_file) if f)
        raise BusConnectError(f"cannot load the NATS TLS files ({files}): {error}") from None
    return context


def connect_options(config: BusConfig, name: str) -> dict[str, Any]:
    """nats-py's `connect` options for `config` (a `BusConnectError` if a file is missing)."""
    options: dict[str, Any] = {"servers": config.nats_urls, "name": name}
    if config.creds_file:
        credentials = read_credentials(config.creds_file)
        options.update(user=credentials.user, password=credentials.password,
                       inbox_prefix=inbox_prefix(credentials.user))
    if config.tls:
        options.update(tls=client_ssl_context(config), tls_handshake_first=True)
    return options


_SILENT_SERVER = "empty response from server when expecting info"
SILENT_ATTEMPTS = 2  # a server that closes before a word this often wants TLS first


def refusal(error: BaseException, config: BusConfig, silent_attempts: int = 0) -> str | None:
    """Why NATS refused this client for good (a one-line reason), or None: worth retrying.
    `silent_attempts`: how many attempts in a row the server closed without a word."""
    text = str(error)
    who = f"the credentials in {config.creds_file}" if config.creds_file else "a client without credentials"
    if type(error).__name__ == "AuthorizationError" or "authorization violation" in text.lower():
        return f"NATS at {redact_url(config.nats_url)} refused {who} (authorization violation)"
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"TLS with NATS at {redact_url(config.nats_url)} failed: its certificate does not verify against "
                f"{config.tls_ca_file} ({error.verify_message})")
    if isinstance(error, ssl.SSLError):
        reason = getattr(error, "verify_message", "") or getattr(error, "reason", "") or text
        return f"TLS with NATS at {redact_url(config.nats_url)} failed: {reason}"
    if ("tls" in text.lower() and "required" in text.lower()) or (
            not config.tls and _SILENT_SERVER in text.lower() and silent_attempts >= SILENT_ATTEMPTS):
        return f"NATS at {redact_url(config.nats_url)} requires TLS: give its CA file (--nats-ca-file)"
    return None


def _gave_up(config: BusConfig, after_s: float | None, errors: list[Exception]) -> BusConnectError:
    why = f": {errors[-1]}" if errors else ""
    return BusConnectError(f"no NATS server answered at {redact_url(config.nats_url)} within {after_s:g} s{why}")


async def connect(bus: BusConfig | str, name: str, *, connect_timeout_s: float = 5.0,
                  give_up_after_s: float | None = None) -> Bus:
    """A connected `Bus` for `bus` (a config, or a bare URL: no credentials, no TLS). A service
    waits for its server as long as it takes; a command line tool passes `give_up_after_s`
    (then a `BusConnectError` naming the last error, instead of retrying for ever)."""
    config = BusConfig(nats_url=bus) if isinstance(bus, str) else bus
    config.validate()
    options = connect_options(config, name)
    connected: Bus | None = None
    refused: list[str] = []
    client = Client()
    attempt: asyncio.Task[None] | None = None
    silent = [0]
    last_error: list[Exception] = []  # while a tool waits for its first connection

    async def error_cb(error: Exception) -> None:
        silent[0] = silent[0] + 1 if _SILENT_SERVER in str(error).lower() else 0
        reason = refusal(error, config, silent[0]) if connected is None else None
        if reason is not None and attempt is not None and not attempt.done():
            refused.append(reason)
            attempt.cancel()  # the client would retry for ever: nothing will change
            return
        if connected is None and give_up_after_s is not None:
            last_error[:] = [error]  # said once, when giving up
            return
        log.warning("%s: NATS error: %s", name, error)

    async def disconnected_cb() -> None:
        if connected is not None:
            connected._disconnected()

    async def reconnected_cb() -> None:
        if connected is not None:
            await connected._reconnected()

    attempt = asyncio.create_task(client.connect(
        **options,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        connect_timeout=connect_timeout_s,
        allow_reconnect=True,
    ))
    await _first_connection(client, attempt, config, give_up_after_s, last_error, refused)
    connected = Bus(client, name, replicas=config.replicas)
    return connected


async def _first_connection(client: Client, attempt: asyncio.Task[None], config: BusConfig,
                            give_up_after_s: float | None, last_error: list[Exception], refused: list[str]) -> None:
    """Wait for `attempt`, the client's first connection. When it runs out of time, or a refusal
    cancelled it, close the client and raise a `BusConnectError` saying why."""
    try:
        await asyncio.wait_for(attempt, give_up_after_s)  # cancels the attempt when it runs out
    except TimeoutError:
        await client.close()
        raise _gave_up(config, give_up_after_s, last_error) from None
    except asyncio.CancelledError:
        if not refused:
            raise
        await client.close()
        raise BusConnectError(refused[0]) from None
