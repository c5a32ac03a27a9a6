"""One AMX instruction sequence, run in a fresh process: what vLLM's AMX attention kernel
meets on its first prompt.

`probe(request_state)` starts a new Python process that, if asked, first runs the vLLM
plugin `connector.vllm.amx.request_amx_state` (as every vLLM process does at its start),
then loads a tile configuration, zeroes tile 0 and releases the tiles (`LDTILECFG`,
`TILEZERO`, `TILERELEASE`, machine code in an executable page). Linux refuses tile data to
a process that never asked for it: the first instruction that touches it raises SIGILL.
Only for a CPU with AMX (elsewhere those instructions are undefined and fault anyway).

Run as a script (`python -m tests.vllm.amx_probe`) it needs only Python and torch, and
prints the CPU's AMX flags and both outcomes: a host check without the rest of the suite.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret
_AMX_CODE = bytes.fromhex("c4e2784907" "c4e27b49c0" "c4e27849c0" "c3")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProbeOutcome:
    returncode: int
    output: str

    @property
    def killed_by_sigill(self) -> bool:
        return self.returncode == -signal.SIGILL

    @property
    def ran(self) -> bool:
        return self.returncode == 0 and "tiles zeroed" in self.output


def run_tile_instructions() -> None:
    """Configure tile 0 (16 rows of 64 bytes), zero it and release the tiles."""
    config = (ctypes.c_uint8 * 64)()
    config[0] = 1  # palette 1
    config[16], config[17] = 64, 0  # tile 0: 64 bytes per row (little-endian uint16)
    config[48] = 16  # tile 0: 16 rows
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(_AMX_CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)(ctypes.addressof(config))
    print("tiles zeroed", flush=True)


def probe(request_state: bool, timeout_s: float = 120) -> ProbeOutcome:
    """Run the tile instructions in a new process, after the plugin if `request_state`."""
    steps = ["import logging", "logging.basicConfig(level=logging.INFO)"]
    if request_state:
        steps += ["from connector.vllm.amx import request_amx_state", "request_amx_state()"]
    steps += ["from tests.vllm.amx_probe import run_tile_instructions", "run_tile_instructions()"]
    done = subprocess.run([sys.executable, "-c", "; ".join(steps)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    return ProbeOutcome(done.returncode, done.stdout + done.stderr)


def amx_flags(cpuinfo_path: str = "/proc/cpuinfo") -> list[str]:
    text = Path(cpuinfo_path).read_text(errors="replace")
    return sorted(set(re.findall(r"\bamx\w*", text)))


def main() -> int:
    from connector.vllm.amx import cpu_has_amx

    print(f"CPU AMX flags: {amx_flags() or 'none'}")
    if not cpu_has_amx():
        print("no AMX on this CPU: nothing to probe")
        return 0
    without, with_plugin = probe(request_state=False), probe(request_state=True)
    print(f"without the plugin: exit {without.returncode} (SIGILL: {without.killed_by_sigill})")
    print(f"with the plugin: exit {with_plugin.returncode} (ran: {with_plugin.ran})\n{with_plugin.output[-2000:]}")
    return 0 if without.killed_by_sigill and with_plugin.ran else 1


if __name__ == "__main__":
    sys.exit(main())
