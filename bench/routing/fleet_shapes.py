"""A fleet of workers of unlike shapes for the routing benchmarks: `--shapes tp1,tp2-bs32,pp2`
gives the workers those shapes in turn (worker i the `i % len(shapes)`-th), each shape one
worker group of the stack. Workers of one model pair and pull prefixes whatever their
shape (`connector.range_plan` maps tensor- and pipeline-parallel ranks and block sizes);
a shape's KV pool holds as many tokens as the run's (its block count scaled by its block
size), so a mixed fleet has the cache of a uniform one. Pure; used by `bench.routing.main`
and `bench.routing.systems`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launch.definition import Settings, WorkerGroup
from shared.schemas import WorkerRole

_PART = re.compile(r"^(tp|pp|bs)(\d+)$")


@dataclass(frozen=True)
class WorkerShape:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    block_size: int = 0  # 0: the run's

    @property
    def name(self) -> str:
        parts = [f"tp{self.tensor_parallel}"] + ([f"pp{self.pipeline_parallel}"] if self.pipeline_parallel > 1 else [])
        return "-".join(parts + ([f"bs{self.block_size}"] if self.block_size else []))

    def settings(self, block_size: int, kv_blocks: int) -> Settings:
        """The worker flags of this shape in a run of `block_size`-token blocks and `kv_blocks` blocks."""
        size = self.block_size or block_size
        return {"tensor_parallel": self.tensor_parallel, "pipeline_parallel": self.pipeline_parallel,
                "block_size": size, "kv_blocks": max(1, kv_blocks * block_size // size)}


def parse_shapes(text: str) -> tuple[WorkerShape, ...]:
    """`tp2-bs32,pp2,tp1` -> shapes; ValueError naming what is wrong."""
    shapes = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        fields: dict[str, int] = {}
        for part in entry.split("-"):
            match = _PART.match(part)
            if match is None or int(match.group(2)) < 1:
                raise ValueError(f"not a worker shape: {entry!r} (say e.g. tp2-pp2-bs32)")
            fields[{"tp": "tensor_parallel", "pp": "pipeline_parallel", "bs": "block_size"}[match.group(1)]] = \
                int(match.group(2))
        shapes.append(WorkerShape(**fields))
    return tuple(shapes)


def worker_groups(count: int, shapes: tuple[WorkerShape, ...], *, engine: str, settings: Settings, block_size: int,
                  kv_blocks: int) -> tuple[WorkerGroup, ...]:
    """`count` workers of role both: one group, or one group per shape taking turns."""
    if not shapes:
        return (WorkerGroup(name="worker", role=WorkerRole.BOTH, count=count, engine=engine,
                            settings={**settings, "kv_blocks": kv_blocks}),)
    counts = [len(range(index, count, len(shapes))) for index in range(len(shapes))]
    return tuple(WorkerGroup(name=f"worker-{shape.name}", role=WorkerRole.BOTH, count=shapes_count, engine=engine,
                             settings={**settings, **shape.settings(block_size, kv_blocks)})
                 for shape, shapes_count in zip(shapes, counts) if shapes_count)
