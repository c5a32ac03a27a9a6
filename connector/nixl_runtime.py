"""NIXL as a runtime: which bindings are installed, and what UCX must be told before an
agent's backend starts (pure glue, no agent). Used by `connector.nixl_agent.KvAgent`."""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

from shared.errors import ErrorCode

log = logging.getLogger(__name__)

# The CUDA-variant wheels (nixl-cu12, nixl-cu13) each ship the same bindings under their own
# name; the `nixl` meta package re-exports one of them.
_BINDING_MODULES = ("nixl_cu12._bindings", "nixl_cu13._bindings", "nixl._bindings")


@functools.cache
def load_nixl() -> ModuleType:
    errors = []
    for name in _BINDING_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors))


def nixl_available() -> bool:
    try:
        load_nixl()
    except ImportError:
        return False
    return True


def allow_cuda_ipc_reads(agent_name: str, enabled: bool, mem_type: str) -> None:
    """Set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y for a pool in GPU memory unless the operator set
    it, before the UCX context is created. UCX reads its configuration from the environment
    when a context is created, and NIXL passes no other way in: this is the one place Tandem
    writes it. UCX's `auto` turns CUDA-IPC reads off without NVLink, and a pull from GPU
    memory then crawls over tcp/lo (0.3-0.5 GB/s; 1,197 GB/s with `y`, H200). A host-memory
    pool leaves it unset: where UCX's CUDA transport cannot load, UCX prints a warning about
    the unused variable on stdout. Process-wide: the first agent's stays."""
    name, value, source = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto", "UCX's default: cuda_ipc_reads is off"
    if name in os.environ:
        value, source = os.environ[name], "set before this agent: left alone"
    elif mem_type != "VRAM":
        source = "UCX's default: the pool is in host memory"
    elif enabled:
        os.environ[name] = value = "y"
        source = "cuda_ipc_reads"
    log.info("KV agent %s: UCX runs with %s=%s (%s)", agent_name, name, value, source)


def error_code(nixl: ModuleType, error: Exception) -> ErrorCode:
    for name, code in (("nixlRemoteDisconnectError", ErrorCode.DISCONNECTED),
                       ("nixlNotFoundError", ErrorCode.NOT_FOUND), ("nixlCancelledError", ErrorCode.CANCELLED)):
        if isinstance(error, getattr(nixl, name)):
            return code
    return ErrorCode.INTERNAL
