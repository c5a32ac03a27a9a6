"""What the stack still holds once the load stops: the workers' latest load snapshots (read
off the bus, as the router and the metrics collector read them) and the router's count of
requests in flight (`/health`).

`settle()` waits, up to a deadline, for reports taken after the load stopped that show no
lease, no used KV block and no request on any worker, and nothing in flight at the
router; it returns what is left either way.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.soak.report import Leftovers
from launch.load_reports import LatestLoads

POLL_S = 0.1


class LoadReports(LatestLoads):
    def leftovers(self, workers: list[str], router_in_flight: int | None, settle_s: float | None) -> Leftovers:
        latest = {worker: self.latest[worker] for worker in workers if worker in self.latest}
        return Leftovers(leases={w: s.active_leases for w, s in latest.items()},
                         used_blocks={w: s.kv_used_blocks for w, s in latest.items()},
                         requests={w: s.running + s.waiting for w, s in latest.items()},
                         router_in_flight=router_in_flight, settle_s=settle_s)

    async def settle(self, http: httpx.AsyncClient, workers: list[str], timeout_s: float) -> Leftovers:
        started = time.monotonic()
        since = {worker: self.latest[worker].seq if worker in self.latest else 0 for worker in workers}
        router_in_flight: int | None = None
        while True:
            router_in_flight = await _router_in_flight(http)
            fresh = all(worker in self.latest and self.latest[worker].seq >= since[worker] + 2 for worker in workers)
            left = self.leftovers(workers, router_in_flight, None)
            if fresh and left.total == 0 and router_in_flight == 0:
                return self.leftovers(workers, router_in_flight, round(time.monotonic() - started, 2))
            if time.monotonic() - started > timeout_s:
                return left
            await asyncio.sleep(POLL_S)  # the poll interval


async def _router_in_flight(http: httpx.AsyncClient) -> int | None:
    try:
        return int((await http.get("/health", timeout=5)).json()["in_flight"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None
