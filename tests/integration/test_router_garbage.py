"""A request the router has served leaves no reference cycle behind: with the cyclic garbage
collector off, its objects (the HTTP exchange, the generation, the disconnect watch) are gone
once it ends, freed by their reference counts. A cycle would keep a request's whole object
graph until a collection, which then also walks everything allocated since: measured under
`tandem bench router`, one young collection every ~375 requests at ~20 ms each.

Against the real router (`RouterServer` under uvicorn) and a real sim worker on the session's
nats-server (router_cluster.py)."""

from __future__ import annotations

import gc
from collections import Counter

from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME

PROMPT = "Hello there, tell me about the river that runs past the old mill in the valley."
REQUESTS_PER_KIND = 4
# where a request's own objects come from: the HTTP exchange, the generate flow, uvicorn's cycle
PER_REQUEST_MODULES = ("services.router.http", "services.router.flows", "uvicorn.protocols")


def _module_of(item: object) -> str:
    module = getattr(type(item), "__module__", "")
    return module if isinstance(module, str) else ""


def _per_request_objects() -> Counter[str]:
    return Counter(f"{_module_of(item)}.{type(item).__qualname__}" for item in gc.get_objects()
                   if _module_of(item).startswith(PER_REQUEST_MODULES))


async def _serve(router: cluster.Router) -> None:
    for _ in range(REQUESTS_PER_KIND):
        await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=4)
        async for _chunk in await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT,
                                                                   max_tokens=4, stream=True):
            pass
        async for _chunk in await router.client.chat.completions.create(
                model=MODEL_DIR_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, stream=True):
            pass


async def test_served_requests_leave_no_cycles_behind(router: cluster.Router, start_worker) -> None:
    await start_worker()
    await cluster.wait_for_workers(router, 1)
    await _serve(router)  # warm: whatever the first requests build once is built now
    await cluster.wait_until_idle(router)
    gc.collect()
    gc.disable()
    try:
        before = _per_request_objects()
        await _serve(router)
        await cluster.wait_until_idle(router)
        grown = {name: count for name, count in (_per_request_objects() - before).items()
                 if count >= REQUESTS_PER_KIND}
        assert grown == {}, f"objects that outlived their requests (held by reference cycles): {grown}"
    finally:
        gc.enable()
