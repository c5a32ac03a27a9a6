"""The one place Tandem sets environment variables for vLLM.

Some vLLM-CPU settings exist only as environment variables read inside the processes
vLLM starts (EngineCore, model worker), and vLLM's CPU platform itself writes variables
into the *calling* process while it builds its config (`LD_PRELOAD` with torch's libgomp,
`VLLM_WORKER_MULTIPROC_METHOD=spawn`, `NUMEXPR_MAX_THREADS`, ...). Child processes copy
the environment when they start, so `engine_environment()` wraps exactly config creation
and process start-up: it sets Tandem's typed settings, lets vLLM add its own, and then
restores the worker's environment, so nothing leaks into processes the worker (or a test
session) starts later.

Variables set here, from `VllmEngineOptions`:
- `VLLM_CPU_OMP_THREADS_BIND` <- `cpu_threads_bind` (the cores the model worker's
  OpenMP threads are pinned to; give two engines on one host disjoint cores), one core list
  per rank at tensor parallel degree > 1 (`options.rank_threads_bind`: vLLM's "auto" needs a
  NUMA node per rank, which a one-node host does not have).
- `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` when `otlp_traces_endpoint` is set:
  vLLM's request spans are made by the worker's (Tandem's) tracer provider, already
  installed when vLLM tries to install its own, but vLLM still builds an exporter for
  that endpoint: the same protocol as Tandem's (vLLM's default is gRPC).
- `TANDEM_WORKER_CPUS` (`connector.progress_threads.WORKER_CPUS`): the cores the worker
  itself may use, where NIXL's progress threads in its ranks may run.
- `VLLM_CPU_KVCACHE_SPACE` is *removed*: it is vLLM's legacy spelling of the KV cache size
  and would silently override `kv_cache_memory_bytes`, which Tandem passes from
  `kv_cache_gib`.

The engine's processes start on the engine's cores (`engine_environment` narrows the
starting thread's binding to every core its ranks are bound to, and children inherit it).
vLLM's EngineCore waits for its model workers' result of each step in a busy loop
(`sched_yield` for up to a second after each result): unbound, it took the *other* engine's
core for the whole of each step. Measured on a 2-core host, one prefill and one decode
engine bound to a core each: a 1,000-token prompt on the prefill engine cost 1.54 s of
EngineCore CPU on the decode engine's core, and the decode engine's streams stalled 200-700
ms as each prompt began; on its own core it yields to its model worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from connector.progress_threads import WORKER_CPUS, thread_ids
from services.worker.vllm.options import VllmEngineOptions, bound_cores, rank_threads_bind

log = logging.getLogger(__name__)


def engine_variables(options: VllmEngineOptions) -> dict[str, str]:
    own = sorted(os.sched_getaffinity(0))
    variables = {"VLLM_CPU_OMP_THREADS_BIND": rank_threads_bind(options.cpu_threads_bind, options.tensor_parallel, own),
                 WORKER_CPUS: ",".join(map(str, own))}
    if options.otlp_traces_endpoint:
        variables["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return variables


@contextmanager
def engine_environment(options: VllmEngineOptions) -> Iterator[None]:
    """Hold the engine's variables while vLLM builds its config and starts its processes."""
    saved = dict(os.environ)
    legacy_kv_space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if legacy_kv_space:
        log.warning("ignoring VLLM_CPU_KVCACHE_SPACE=%s: the KV cache size is %.2f GiB from "
                    "Tandem's config", legacy_kv_space, options.kv_cache_gib)
    variables = engine_variables(options)
    os.environ.update(variables)
    try:
        with _processes_on(bound_cores(variables["VLLM_CPU_OMP_THREADS_BIND"])):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _processes_on(cores: set[int]) -> Iterator[None]:
    """Processes this thread starts inside the block run on `cores` (all of the worker's
    where that names none, or none it may use); threads started meanwhile keep the worker's."""
    own = os.sched_getaffinity(0)
    target = cores & own
    if not target or target == own:
        yield
        return
    before = thread_ids()
    os.sched_setaffinity(0, target)
    log.info("vLLM's engine processes start on cores %s, where its ranks are bound",
             ",".join(map(str, sorted(target))))
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
        for tid in thread_ids() - before:
            try:
                os.sched_setaffinity(tid, own)
            except OSError:  # it ended already
                continue
