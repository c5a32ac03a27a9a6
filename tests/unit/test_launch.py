"""The stack definition as data: loading, validation, `tandem up`'s overrides, expansion
into worker instances and their command lines."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from launch.argv import router_args, worker_args
from launch.definition import (
    DefinitionError,
    default_definition_path,
    load_definition,
    parse_definition,
    with_overrides,
)
from launch.plan import StackConfig, WorkerSpec, plan_stack
from launch.service_commands import WORKER_COMMAND
from launch.up import UpOptions, run_up
from shared.schemas import WorkerRole


def test_the_packaged_local_stack_is_one_prefill_and_one_decode_sim_worker() -> None:
    definition = load_definition(default_definition_path())
    active = [(group.name, group.role, group.count, group.engine) for group in definition.workers if group.count]
    assert active == [("prefill", WorkerRole.PREFILL, 1, "sim"), ("decode", WorkerRole.DECODE, 1, "sim")]
    assert (definition.router.port, definition.router.health) == (8000, "/health")
    assert (definition.metrics.port, definition.metrics.health) == (9100, "/metrics")
    assert definition.nats.url == ""  # embedded


def test_type_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    path.write_text('[[workers]]\nname = "w"\nrole = "decode"\ncount = "two"\n')
    with pytest.raises(DefinitionError, match=r"stack.toml.*workers\[0\]\.count"):
        load_definition(path)
    path.write_text("[router\n")
    with pytest.raises(DefinitionError, match="not valid TOML"):
        load_definition(path)
    with pytest.raises(DefinitionError, match="cannot read"):
        load_definition(tmp_path / "missing.toml")
    with pytest.raises(DefinitionError, match="unknown field `routr`"):
        parse_definition({"routr": {}})  # unknown fields are refused, not ignored


@pytest.mark.parametrize(("data", "problem"), [
    ({"workers": [{"name": "p", "role": "prefill"}]}, "at least one decode"),
    ({"workers": [{"name": "w", "role": "both", "engine": "tpu"}]}, "unknown engine 'tpu'"),
    ({"workers": [{"name": "w", "role": "both", "count": -1}]}, "cannot be negative"),
    ({"workers": [{"name": "w", "role": "both"}, {"name": "w", "role": "decode"}]}, "used twice"),
    ({"workers": [{"name": "router", "role": "both"}]}, "not a usable group name"),
    ({"workers": [{"name": "w", "role": "both", "settings": {"worker_id": "x"}}]}, "set by the definition"),
    ({"workers": [{"name": "w", "role": "both", "settings": {"Bad-Name": 1}}]}, "not an option name"),
    ({"workers": [{"name": "w", "role": "both", "depends_on": ["etcd"]}]}, "no service named 'etcd'"),
    ({"workers": [{"name": "w", "role": "both"}], "orchestrator": {"depends_on": ["router"]}}, "cycle"),
    ({"workers": [{"name": "w", "role": "both"}], "router": {"port": 70000, "health": "/health"}}, "not a port"),
    ({"workers": [{"name": "w", "role": "both"}], "membership": {"ttl_s": 0.5}}, "two heartbeat intervals"),
])
def test_unrunnable_definitions_are_refused_with_the_reason(data: dict, problem: str) -> None:
    with pytest.raises(DefinitionError, match=problem):
        parse_definition(data)


def test_overrides_set_counts_ports_engine_and_nats() -> None:
    definition = load_definition(default_definition_path())
    changed = with_overrides(definition, engine="vllm", counts={WorkerRole.PREFILL: 2, WorkerRole.BOTH: 1},
                             router_port=0, metrics_port=0, nats_url="nats://elsewhere:4222", model_dir="/m")
    counts = {group.name: (group.count, group.engine) for group in changed.workers}
    assert counts == {"prefill": (2, "vllm"), "decode": (1, "vllm"), "worker": (1, "vllm")}
    assert (changed.router.port, changed.metrics.port) == (0, 0)
    assert (changed.nats.url, changed.model_dir) == ("nats://elsewhere:4222", "/m")
    assert with_overrides(definition) == definition


def test_a_count_for_a_role_without_a_group_adds_one() -> None:
    definition = parse_definition({"workers": [{"name": "d", "role": "decode", "settings": {"sim_speedup": 2.0}}]})
    changed = with_overrides(definition, counts={WorkerRole.BOTH: 2})
    assert [(group.name, group.role, group.count, group.settings) for group in changed.workers] == [
        ("d", WorkerRole.DECODE, 1, {"sim_speedup": 2.0}), ("worker", WorkerRole.BOTH, 2, {"sim_speedup": 2.0})]


def test_plan_names_workers_by_group_and_pins_engines_through_the_registry() -> None:
    definition = with_overrides(load_definition(default_definition_path()), counts={WorkerRole.DECODE: 2},
                                model_dir="/m")
    sim = plan_stack(definition, log_dir="/logs", cores=[0, 1])
    assert [(spec.worker_id, spec.role) for spec in sim.workers] == [
        ("prefill-1", WorkerRole.PREFILL), ("decode-1", WorkerRole.DECODE), ("decode-2", WorkerRole.DECODE)]
    assert all(spec.engine_args == () for spec in sim.workers)
    assert sim.resolved_start_timeout_s() == 60.0
    vllm = plan_stack(with_overrides(definition, engine="vllm"), log_dir="/logs", cores=[2, 3])
    assert [spec.engine_args[2:] for spec in vllm.workers] == [("--vllm-cpu-threads-bind", core)
                                                               for core in ("2", "3", "2")]
    assert vllm.resolved_start_timeout_s() == 300.0
    with pytest.raises(DefinitionError, match="at least one decode"):
        plan_stack(with_overrides(definition, counts={WorkerRole.DECODE: 0}), log_dir="/logs")


def test_settings_become_options_and_verbatim_flags_come_last() -> None:
    assert WORKER_COMMAND.setting_flags({"kv_lease_ttl": 3, "kv_transfer": False, "vllm_eager": True,
                                         "model_version": "v2"}) == [
        "--kv-lease-ttl", "3.0", "--no-kv-transfer", "--vllm-eager", "--model-version", "v2"]
    config = StackConfig(model_dir="/m", namespace="ns", router_port=0, router_settings={"routing_policy": "random"},
                         router_args=("--local-prefill-tokens", "0"))
    spec = WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, engine_args=("--x", "1"), settings={"kv_blocks": 64},
                      extra_args=("--kv-fault-delay", "1.5"))
    argv = worker_args(config, "nats://n:1", spec)
    assert argv == ["worker", "--worker-id", "d1", "--role", "decode", "--engine", "sim", "--model-dir", "/m",
                    "--nats-url", "nats://n:1", "--namespace", "ns", "--heartbeat-interval", "0.5", "--ttl", "3.0",
                    "--x", "1", "--kv-blocks", "64", "--kv-fault-delay", "1.5"]
    router = router_args(config, "nats://n:1", 8123)
    assert router[router.index("--port"):] == ["--port", "8123", "--model-dir", "/m", "--heartbeat-interval", "0.5",
                                               "--ttl", "3.0", "--routing-policy", "random",
                                               "--local-prefill-tokens", "0"]


@pytest.mark.parametrize("options", [
    UpOptions(engine="tpu"),
    UpOptions(decode=0),
    UpOptions(prefill=-1),
    UpOptions(port=70000),
])
def test_up_refuses_before_starting_anything(tmp_path: Path, options: UpOptions) -> None:
    state_dir = tmp_path / "state"
    assert run_up(dataclasses.replace(options, state_dir=str(state_dir))) == 2
    assert not state_dir.exists()  # no model generated, no log, no process


def test_up_refuses_a_definition_file_that_cannot_run(tmp_path: Path) -> None:
    stack = tmp_path / "stack.toml"
    stack.write_text('[[workers]]\nname = "p"\nrole = "prefill"\n')
    assert run_up(UpOptions(stack=str(stack), state_dir=str(tmp_path / "state"))) == 2
