"""AMX tile state in a fresh process, without vLLM's engines: the mechanism behind the
SIGILL that killed vLLM workers on AMX hosts, and the plugin that prevents it.

Where the CPU has AMX: a process that runs an AMX instruction without asking for tile
state dies of SIGILL (what vLLM's AMX attention kernel met on its first prompt), and one
that ran the plugin first (as every vLLM process does) runs it. Reverting the plugin to a
no-op fails the second half. Elsewhere: the plugin says there is no AMX and asks for
nothing. `test_vllm_engine_death.py` checks the same on real engines (the kernel vLLM runs,
and the state granted to each of its processes).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the plugin asks for AMX state through torch (vLLM venv)")

from connector.vllm.amx import cpu_has_amx  # noqa: E402
from tests.vllm.amx_probe import ROOT, probe  # noqa: E402


@pytest.mark.skipif(not cpu_has_amx(), reason="the CPU has no AMX (the next test covers this host)")
def test_on_an_amx_cpu_the_plugin_gives_a_fresh_process_the_tile_state() -> None:
    without = probe(request_state=False)
    assert without.killed_by_sigill, f"an AMX instruction ran without tile state: {without}"
    with_plugin = probe(request_state=True)
    assert with_plugin.ran, f"the plugin did not make AMX usable: {with_plugin}"
    assert "AMX tile state granted to pid" in with_plugin.output, with_plugin.output


@pytest.mark.skipif(cpu_has_amx(), reason="the CPU has AMX (the test above covers this host)")
def test_without_amx_the_plugin_asks_for_nothing_and_says_so() -> None:
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from connector.vllm.amx import request_amx_state, amx_state_granted; "
            "request_amx_state(); print('granted', amx_state_granted())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no AMX on this CPU" in done.stderr and "granted False" in done.stdout, (done.stdout, done.stderr)
