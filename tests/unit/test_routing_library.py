"""The routing library (ARCHITECTURE.md, "The routing library"): the KV index and the routing
policy used by a program of their own, in a fresh interpreter, load nothing of the router
service (its HTTP, flows, fleet, config) and no I/O package, and route a request to the
worker the index says holds its prompt. The import contract "The routing library imports
no service code" (pyproject.toml) keeps it so statically; this checks what Python loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import json, sys
from services.router.kv.index import KvIndex, block_hashes_for
from services.router.routing import RouteRequest, WorkerView, decide
from services.router.routing.config import RoutingConfig
from shared.schemas import WorkerRole, WorkerStatus

prompt = list(range(100, 164))  # 4 blocks of 16 tokens
index = KvIndex()
for worker_id in ("w1", "w2"):
    index.add_worker(worker_id, block_size=16)
index.add_speculative("w2", block_hashes_for(prompt, 16), expires_at=float("inf"))
blocks = index.match_tokens(prompt)
workers = [WorkerView(worker_id=worker_id, model="m", role=WorkerRole.BOTH, status=WorkerStatus.ACTIVE,
                      max_num_seqs=8, max_model_len=1024, reported_load=0, in_flight=0, in_flight_at_report=0,
                      last_routed=0, compat_hash="h", block_size=16) for worker_id in ("w1", "w2")]
cached = {worker_id: count * 16 for worker_id, count in blocks.items()}
plan = decide(workers, RouteRequest(model="m", prompt_tokens=len(prompt), total_tokens=80, cached_tokens=cached,
                                    held_tokens=cached), RoutingConfig())
print(json.dumps({"worker": plan.worker_id, "cached": cached, "modules": sorted(sys.modules)}))
"""

SERVICE_CODE = ("services.router.http", "services.router.flows", "services.router.fleet", "services.router.openai",
                "services.router.config", "services.router.kv.view", "services.router.main", "services.worker",
                "services.orchestrator", "services.metrics", "connector", "launch", "cli")
IO_PACKAGES = ("nats", "fastapi", "starlette", "uvicorn", "httpx", "asyncio")


def test_the_index_and_the_policy_route_a_request_loading_no_service_code() -> None:
    run = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert (answer["worker"], answer["cached"]) == ("w2", {"w2": 64})
    loaded = [module for module in answer["modules"]
              if module.startswith(SERVICE_CODE) or module.split(".")[0] in IO_PACKAGES]
    assert not loaded, loaded
