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
- `VLLM_CPU_KVCACHE_SPACE` is *removed*: it is vLLM's legacy spelling of the KV cache size
  and would silently override `kv_cache_memory_bytes`, which Tandem passes from
  `kv_cache_gib`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from services.worker.vllm.options import VllmEngineOptions, rank_threads_bind

log = logging.getLogger(__name__)


def engine_variables(options: VllmEngineOptions) -> dict[str, str]:
    variables = {"VLLM_CPU_OMP_THREADS_BIND": rank_threads_bind(options.cpu_threads_bind, options.tensor_parallel,
                                                                 sorted(os.sched_getaffinity(0)))}
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
    os.environ.update(engine_variables(options))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
