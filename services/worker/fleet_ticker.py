"""One ticker for the periodic work of a whole fleet of workers in one process.

A worker has three periodic actions (heartbeat, KV event flush, load snapshot), each on its
own timer when it runs alone. A fleet of N workers would hold 3N sleeping tasks whose
wake-ups bunch together; instead `FleetTicker` runs one task per action. Each period is
cut into slices (`slice_groups`, pure) and each slice acts for its share of the workers,
so N heartbeats are spread evenly over the interval instead of arriving as one burst at
the bus, the members bucket and every watcher of it.

A slice's actions run one after the other (a publish only fills the connection's buffer),
or, when asked, each in a task of its own that the ticker does not wait for (a heartbeat
waits for JetStream's ack: on a busy server that takes long, and waiting would stretch the
period for every worker until their heartbeats outlive the TTL); a worker whose previous
one is still pending skips its turn. Each one's failure is its worker's (NATS reconnecting: logged, tried again next period), never the
ticker's. A ticker that falls behind (a busy loop) skips the missed slices' catch-up rather
than firing them back to back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from shared.lifecycle import reraise_if_cancelling
from shared.tasks import cancel_all

log = logging.getLogger(__name__)

MIN_SLICE_S = 0.01  # no finer than this: timer wake-ups are not free either


def slice_groups(count: int, interval_s: float, min_slice_s: float = MIN_SLICE_S) -> list[list[int]]:
    """Worker indexes `0..count-1` in slices, one slice per `interval_s / len(slices)`: as many
    slices as the interval allows at `min_slice_s` each, at most one per worker; worker `i`
    is in slice `i % len(slices)`, so every slice holds about as many."""
    if count <= 0:
        return []
    slices = max(1, min(count, int(interval_s / min_slice_s)))
    return [list(range(first, count, slices)) for first in range(slices)]


Action = Callable[[int], Awaitable[None]]  # the periodic work of worker `index`


class FleetTicker:
    def __init__(self, count: int, is_live: Callable[[int], bool]) -> None:
        self._count = count
        self._is_live = is_live  # a stopped worker's periodic work is skipped
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}  # detached actions not yet done

    def every(self, name: str, interval_s: float, action: Action, *, concurrent: bool = False) -> None:
        """Run `action` for every live worker once per `interval_s`, spread over the interval;
        `concurrent`: each action in a task of its own, not waited for (each waits for an answer)."""
        groups = slice_groups(self._count, interval_s)
        self._tasks.append(asyncio.create_task(self._run(name, interval_s / len(groups), groups, action, concurrent),
                                               name=f"fleet-ticker:{name}"))

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        await cancel_all(list(self._pending.values()))

    async def _run(self, name: str, slice_s: float, groups: Sequence[list[int]], action: Action,
                   concurrent: bool) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            for group in groups:
                due += slice_s
                delay = due - loop.time()
                if delay < -slice_s * len(groups):  # a whole period behind: start afresh, no burst
                    due = loop.time()
                    delay = 0.0
                await asyncio.sleep(max(0.0, delay))
                for index in group:
                    if not self._is_live(index):
                        continue
                    if concurrent:
                        self._detach(name, action, index)
                    else:
                        await self._act(name, action, index)

    def _detach(self, name: str, action: Action, index: int) -> None:
        key = (name, index)
        if key in self._pending:
            return  # its previous one is still waiting: no pile-up
        task = asyncio.create_task(self._act(name, action, index))
        self._pending[key] = task
        task.add_done_callback(lambda _: self._pending.pop(key, None))

    async def _act(self, name: str, action: Action, index: int) -> None:
        try:
            await action(index)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # NATS reconnecting: this worker tries again next period
            reraise_if_cancelling(error)
            log.debug("%s of worker #%d failed: %s", name, index, error)
