"""The router's API key middleware in process (an app with stand-in routes, a test clock):
what each path needs, `metrics_auth`, a slot released when a route raises, and the warning
of an open router."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from services.router.config import RouterConfig
from services.router.http.auth.middleware import install_api_keys
from services.router.main import router_app
from services.router.metrics import RouterMetrics
from shared.api_keys import ApiKey, KeyTable, hash_key
from shared.api_keys_file import write_key_file
from shared.codec import MalformedCounter
from shared.config import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def guarded_app(path: Path, metrics_auth: str = "open") -> FastAPI:
    write_key_file(path, KeyTable((ApiKey(name="alice", sha256=hash_key("ka"), max_concurrent=1),)))
    app = FastAPI()

    @app.get("/v1/echo")
    def echo() -> dict:
        return {"ok": True}

    @app.get("/v1/fail")
    def fail() -> dict:
        raise RuntimeError("route failed")

    @app.get("/metrics")
    def metrics() -> dict:
        return {}

    @app.get("/health")
    def health() -> dict:
        return {}

    install_api_keys(app, RouterConfig(api_keys_file=str(path), metrics_auth=metrics_auth),  # type: ignore[arg-type]
                     RouterMetrics(MalformedCounter()), Clock())
    return app


async def get(app: FastAPI, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                                 base_url="http://router") as http:
        return await http.get(path, headers=headers)


async def test_api_needs_a_key_probes_and_metrics_do_not(tmp_path: Path) -> None:
    app = guarded_app(tmp_path / "keys.jsonl")
    assert (await get(app, "/v1/echo")).status_code == 401
    assert (await get(app, "/v1/echo", "ka")).json() == {"ok": True}
    assert (await get(app, "/health")).status_code == 200
    assert (await get(app, "/metrics")).status_code == 200


async def test_metrics_auth_api_key_guards_metrics_without_limits(tmp_path: Path) -> None:
    app = guarded_app(tmp_path / "keys.jsonl", "api-key")
    refused = await get(app, "/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_key"
    for _ in range(3):  # max_concurrent does not apply to scrapes
        assert (await get(app, "/metrics", "ka")).status_code == 200
    assert (await get(app, "/health")).status_code == 200


async def test_a_route_that_raises_releases_its_slot(tmp_path: Path) -> None:
    app = guarded_app(tmp_path / "keys.jsonl")
    assert (await get(app, "/v1/fail", "ka")).status_code == 500
    assert (await get(app, "/v1/echo", "ka")).status_code == 200  # max_concurrent 1: the slot came back


def test_an_open_router_warns_once_and_a_bad_key_file_fails_the_start(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        router_app(RouterConfig(model_dir="unused"))
    assert [record.message for record in caplog.records if "OPEN" in record.message] != []
    assert sum("OPEN" in record.message for record in caplog.records) == 1
    (tmp_path / "bad.jsonl").write_text("nonsense\n")
    with pytest.raises(ConfigError, match="line 1"):
        router_app(RouterConfig(model_dir="unused", api_keys_file=str(tmp_path / "bad.jsonl")))
    with pytest.raises(ConfigError, match="cannot read"):
        router_app(RouterConfig(model_dir="unused", api_keys_file=str(tmp_path / "absent.jsonl")))
    with pytest.raises(ConfigError, match="metrics_auth"):
        RouterConfig(model_dir="unused", metrics_auth="api-key").validate()
