"""Topology names for `tandem bench serve --compare`: pure parsing, and each topology as a
stack definition (`launch.definition`).

- "NpMd": N prefill and M decode workers; the router disaggregates every request
  (`local_prefill_tokens = 0`: no prompt is short enough to stay on the decode worker).
- "Nx1": N workers of role both, each serving whole requests (N single-engine replicas).
- "Nxany": N workers of role both, any of which may compute a prompt for another: the router
  disaggregates a request only where its cost model says it wins (`prefill_from` "any",
  with the interference terms weighted by `itl_weight` and `itl_budget_tokens`, derived from
  the run's SLO and, on the sim, its timing profile: `bench.serve.interference`).
- "Nxvllm": not Tandem but its peer, N plain vLLM servers behind vllm-router
  (round-robin), as `bench.serve.peer` runs them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from launch.definition import HttpService, Settings, StackDefinition, WorkerGroup
from launch.plan import WorkerSpec
from launch.plan import worker_specs as plan_worker_specs
from shared.schemas import WorkerRole

_DISAGGREGATED = re.compile(r"(\d+)p(\d+)d")
_REPLICAS = re.compile(r"(\d+)x1")
_ANY = re.compile(r"(\d+)xany")
_PEER = re.compile(r"(\d+)xvllm")
ALWAYS_DISAGGREGATE: Settings = {"local_prefill_tokens": 0}


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    prefill: int = 0
    decode: int = 0
    single: int = 0  # workers of role both
    peer: int = 0  # plain vLLM servers behind vllm-router (no Tandem)
    any_prefill: bool = False  # the workers of role both may compute prompts for one another
    itl_weight: float = 1.0  # with `any_prefill`: the router's interference weight
    itl_budget_tokens: float = 0.0  # ... and what a decoding request absorbs before its ITL SLO (0: nothing)

    @property
    def router_settings(self) -> Settings:
        if self.any_prefill:
            return {"prefill_from": "any", "itl_weight": self.itl_weight, "itl_budget_tokens": self.itl_budget_tokens}
        return dict(ALWAYS_DISAGGREGATE) if self.prefill else {}


def parse_topology(name: str) -> Topology:
    """"1p1d", "2p2d", "2x1", ... (case-insensitive); ValueError for anything else."""
    text = name.strip().lower()
    if match := _DISAGGREGATED.fullmatch(text):
        prefill, decode = int(match.group(1)), int(match.group(2))
        if prefill < 1 or decode < 1:
            raise ValueError(f"topology {name!r}: needs at least one prefill and one decode worker")
        return Topology(name=text, prefill=prefill, decode=decode)
    if match := _REPLICAS.fullmatch(text):
        if int(match.group(1)) < 1:
            raise ValueError(f"topology {name!r}: needs at least one worker")
        return Topology(name=text, single=int(match.group(1)))
    if match := _ANY.fullmatch(text):
        if int(match.group(1)) < 2:
            raise ValueError(f"topology {name!r}: needs at least two workers to prefill for one another")
        return Topology(name=text, single=int(match.group(1)), any_prefill=True)
    if match := _PEER.fullmatch(text):
        if int(match.group(1)) < 1:
            raise ValueError(f"topology {name!r}: needs at least one vLLM server")
        return Topology(name=text, peer=int(match.group(1)))
    raise ValueError(f"unknown topology {name!r}: use NpMd (e.g. 1p1d), Nx1 (e.g. 2x1), Nxany (e.g. 2xany) or "
                     f"Nxvllm (e.g. 2xvllm)")


def parse_topologies(value: str) -> list[Topology]:
    """A comma-separated list of at least two distinct topologies."""
    topologies = [parse_topology(name) for name in value.split(",") if name.strip()]
    names = [topology.name for topology in topologies]
    if len(topologies) < 2 or len(set(names)) != len(names):
        raise ValueError(f"--compare needs at least two distinct topologies, got {value!r}")
    return topologies


def stack_definition(topology: Topology, engine: str, model_dir: str = "", worker_settings: Settings | None = None,
                     ) -> StackDefinition:
    """The topology's stack: its workers (all on `engine`, each with `worker_settings`), a
    router and a metrics collector on free ports."""
    settings = dict(worker_settings or {})
    groups = tuple(WorkerGroup(name=name, role=role, count=count, engine=engine, settings=settings)
                   for name, role, count in (("prefill", WorkerRole.PREFILL, topology.prefill),
                                             ("decode", WorkerRole.DECODE, topology.decode),
                                             ("worker", WorkerRole.BOTH, topology.single)) if count)
    return StackDefinition(name=topology.name, model_dir=model_dir, workers=groups,
                           router=HttpService(port=0, health="/health", settings=topology.router_settings),
                           metrics=HttpService(port=0, health="/metrics"))


def worker_specs(topology: Topology, engine: str, cores: Sequence[int],
                 worker_settings: Settings | None = None) -> tuple[WorkerSpec, ...]:
    """Each worker's spec, with its engine's per-worker launch options (vLLM: one core each,
    round-robin over `cores`)."""
    return plan_worker_specs(stack_definition(topology, engine, worker_settings=worker_settings), cores)
