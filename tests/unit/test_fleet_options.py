"""`tandem worker-fleet`'s worker options are the worker config's flags with the fleet's
defaults (`cli.fleet`): the template it builds is the one it always built."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app
from services.worker.config import FleetConfig
from services.worker.sim.config import SimEngineConfig
from shared.config import BusConfig, KvTransferConfig, WorkerConfig
from shared.schemas import WorkerRole
from tests.unit.service_command_parsing import clear_flag_environment


def fleet_config(monkeypatch: pytest.MonkeyPatch, *args: str) -> FleetConfig:
    import cli.fleet
    import services.worker.fleet

    clear_flag_environment(monkeypatch)
    started: list[Any] = []
    monkeypatch.setattr(services.worker.fleet, "run_fleet", lambda config: config)
    monkeypatch.setattr(cli.fleet, "run_service", started.append)
    result = CliRunner().invoke(app, ["worker-fleet", "--model-dir", "/m", *args])
    assert result.exit_code == 0, result.output
    return started[0]


def fleet_worker(monkeypatch: pytest.MonkeyPatch, *args: str) -> WorkerConfig:
    return fleet_config(monkeypatch, *args).worker


def test_the_fleet_s_defaults_are_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fleet_worker(monkeypatch) == WorkerConfig(
        worker_id="template", model_dir="/m", kv_blocks=256, load_interval_s=1.0,
        kv_transfer=KvTransferConfig(transport="memory", lease_sweep_interval_s=1.0))
    assert fleet_config(monkeypatch).sim == SimEngineConfig(kv_dim=8)
    assert fleet_config(monkeypatch, "--sim-speedup", "4", "--sim-kv-dim", "16").sim == SimEngineConfig(
        speedup=4.0, kv_dim=16)


def test_the_fleet_s_options_set_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = fleet_worker(monkeypatch, "--role", "decode", "--kv-blocks", "64", "--no-kv-transfer",
                          "--kv-lease-sweep-interval", "2", "--nats-url", "nats://n:4", "--ttl", "9")
    assert (worker.role, worker.kv_blocks, worker.bus, worker.membership.ttl_s) == (
        WorkerRole.DECODE, 64, BusConfig(nats_url="nats://n:4"), 9.0)
    assert worker.kv_transfer == KvTransferConfig(enabled=False, transport="memory", lease_sweep_interval_s=2.0)


def test_a_fleet_takes_no_option_it_would_not_honour() -> None:
    result = CliRunner().invoke(app, ["worker-fleet", "--model-dir", "/m", "--tensor-parallel", "2"])
    assert result.exit_code == 2 and "No such option" in result.output
