"""What the planner did during one arm of `tandem bench planner live` (`bench.planner.live`):
its ticks as they happen (`PlannerWatch`, subscribed to the stack's `planner.decisions` by
`watching` while the arm is driven) and, afterwards, its lines in the orchestrator's log
(`planner_lines`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from nats.aio.msg import Msg

from launch.stack import LocalStack
from shared.bus import connect
from shared.codec import Codec
from shared.schemas.planner import PlannerDecision
from shared.subjects import Subjects


class PlannerWatch:
    """The planner's ticks over a run (its `planner.decisions` events): every tick that acts,
    and every `every_s` one that does not, with its notes and pressures (why it did not)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.ticks: list[dict] = []
        self._codec: Codec[PlannerDecision] = Codec(PlannerDecision)
        self._start = time.monotonic()
        self._last_idle = -every_s

    def started(self) -> None:
        self._start = time.monotonic()

    async def on_decision(self, msg: Msg) -> None:
        decision = self._codec.decode(msg.data)
        at = time.monotonic() - self._start
        if not decision.actions and at - self._last_idle < self.every_s:
            return
        if not decision.actions:
            self._last_idle = at
        self.ticks.append({"at_s": round(at, 1), "actions": [repr(action) for action in decision.actions],
                           "notes": decision.notes, "pressures": {role: round(value, 2) for role, value
                                                                  in decision.pressures.items()}})


@contextlib.asynccontextmanager
async def watching(stack: LocalStack, watch: PlannerWatch | None) -> AsyncIterator[None]:
    """`watch` subscribed to the stack's planner decisions meanwhile (nothing when None)."""
    if watch is None:
        yield
        return
    bus = await connect(stack.operator_bus, "bench-planner-live")
    try:
        await bus.client.subscribe(Subjects(stack.config.namespace).planner_decisions, cb=watch.on_decision)
        yield
    finally:
        await bus.close()


def planner_lines(log_path: Path) -> list[str]:
    """The orchestrator's planner lines (its decisions and their outcomes)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if "planner" in line and "no action" not in line]
