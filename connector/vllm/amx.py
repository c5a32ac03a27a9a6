"""AMX tile state for vLLM's CPU kernels, asked for in every vLLM process (a vLLM plugin).

On an x86 CPU with AMX, Linux hands a process the AMX tile registers only after it asked
for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); an AMX instruction run
before that raises SIGILL. vLLM's CPU attention picks its AMX kernel for bfloat16 when
`torch.cpu._is_amx_tile_supported()` (`cpu_attn._get_attn_isa`), but nothing in vLLM asks
for the state first: a model-worker process whose first AMX instruction is that kernel's
dies on its first prompt (oneDNN asks for the state itself, so a process that ran a
oneDNN bfloat16 matmul first survives, which is why it depends on the prompt).

`request_amx_state` is registered as a `vllm.general_plugins` entry point (pyproject), so
vLLM calls it at the start of each of its processes (engine core, model workers) before
any model code. It asks through torch (`torch.cpu._init_amx`), checks with
`ARCH_GET_XCOMP_PERM` that the kernel granted it, and logs the outcome. Where the CPU has
no AMX it does nothing but log that.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

# Under vLLM's logger: vLLM spawns its processes and sets up only its own logging there.
log = logging.getLogger("vllm.tandem_amx")

_ARCH_GET_XCOMP_PERM = 0x1022  # arch/x86/include/uapi/asm/prctl.h
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64


def cpu_has_amx(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU lists AMX tiles (`amx_tile`) among its flags."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as cpuinfo:
            return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo)
    except OSError:
        return False


def amx_state_granted() -> bool:
    """Whether this process may use the AMX tile registers (Linux x86-64 only)."""
    if platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False  # a kernel without dynamic XSAVE features (before 5.16): no AMX for anyone
    return bool(features.value & (1 << _XFEATURE_XTILEDATA))


def request_amx_state() -> None:
    """The plugin: ask for AMX tile state where the CPU has AMX, and say what was granted."""
    if not cpu_has_amx():
        log.info("tandem: no AMX on this CPU (pid %d): vLLM's CPU kernels use AVX-512/AVX2", os.getpid())
        return
    import torch  # the vLLM venv's; imported here so that a process without AMX never needs it

    torch.cpu._init_amx()
    if amx_state_granted():
        log.info("tandem: AMX tile state granted to pid %d (vLLM's AMX kernels may run)", os.getpid())
    else:
        log.warning("tandem: the kernel refused AMX tile state to pid %d: vLLM's AMX kernels would fault",
                    os.getpid())
