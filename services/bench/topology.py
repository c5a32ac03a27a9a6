"""Topology names for `tandem bench serve --compare`: pure parsing and worker specs.

- "NpMd": N prefill and M decode workers; the router disaggregates every request
  (`--local-prefill-tokens 0`: no prompt is short enough to stay on the decode worker).
- "Nx1": N workers of role both, each serving whole requests (N single-engine replicas).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.orchestrator.stack import WorkerSpec
from services.orchestrator.stack import worker_specs as stack_worker_specs

_DISAGGREGATED = re.compile(r"(\d+)p(\d+)d")
_REPLICAS = re.compile(r"(\d+)x1")
ALWAYS_DISAGGREGATE = ("--local-prefill-tokens", "0")


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    prefill: int = 0
    decode: int = 0
    single: int = 0  # workers of role both

    @property
    def router_args(self) -> tuple[str, ...]:
        return ALWAYS_DISAGGREGATE if self.prefill else ()


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
    raise ValueError(f"unknown topology {name!r}: use NpMd (e.g. 1p1d) or Nx1 (e.g. 2x1)")


def parse_topologies(value: str) -> list[Topology]:
    """A comma-separated list of at least two distinct topologies."""
    topologies = [parse_topology(name) for name in value.split(",") if name.strip()]
    names = [topology.name for topology in topologies]
    if len(topologies) < 2 or len(set(names)) != len(names):
        raise ValueError(f"--compare needs at least two distinct topologies, got {value!r}")
    return topologies


def worker_specs(topology: Topology, engine: str, cores: Sequence[int], worker_args: Sequence[str] = (),
                 vllm_kv_cache_gib: float = 0.5) -> tuple[WorkerSpec, ...]:
    """Each worker's spec; vLLM workers are pinned to `cores` round-robin (one core each)."""
    return stack_worker_specs(topology.prefill, topology.decode, topology.single, engine, cores,
                              vllm_kv_cache_gib=vllm_kv_cache_gib, extra_args=worker_args)
