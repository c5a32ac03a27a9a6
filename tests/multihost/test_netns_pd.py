"""Prefill and decode on two simulated hosts: KV over NIXL/UCX TCP between network namespaces.

Three namespaces made by the test (`tests.multihost.netns`): a hub running nats-server, a
prefill host and a decode host, joined by veth pairs on a private subnet. A sim prefill
worker runs in one host's namespace and a sim decode worker in the other's (`ip netns exec`),
each with UCX restricted to TCP on its own interface (`UCX_TLS=tcp`,
`UCX_NET_DEVICES=<its veth>`): shared memory and CMA, which cross namespaces on one kernel,
are ruled out. The router runs in the root namespace; every request is disaggregated.

Each answer (greedy) equals the single-worker answer; each prompt's KV is pulled whole
(nothing recomputed); the bytes pulled crossed the hosts' interfaces (their counters grew
at least that much); and the decode host's KV connection is to the prefill host's address
on the subnet. Skipped, saying why, only when not root or `ip` is missing, and never with
CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.process import LocalLauncher, ManagedProcess
from launch.readiness import reserve_port, wait_http_ok, wait_registered
from shared.bus import connect
from shared.lifecycle import die_with_parent
from shared.nats_server import EmbeddedNats
from shared.schemas import TransferRecord
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.test_disaggregated import as_router_text, reference
from tests.multihost.netns import SimulatedHost, SimulatedHosts
from tests.stack_fixtures import collect, records_arrived

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 60.0
PROMPT_LENGTHS = (40, 129, 300)  # tokens: under a few blocks, one past a block edge, many blocks
MAX_TOKENS = 16


def netns_problem() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "iproute2 (`ip`, `ss`) is not installed"
    return ""


@pytest.fixture
def hosts() -> Iterator[SimulatedHosts]:
    problem = netns_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"simulated hosts cannot run here: {problem} (CI=true: not skipped)")
        pytest.skip(f"simulated hosts cannot run here: {problem}")
    with SimulatedHosts(["prefill", "decode"]) as made:
        yield made
    assert not made.leftovers(), f"namespaces or interfaces left behind: {made.leftovers()}"


def start_worker(launcher: LocalLauncher, host: SimulatedHost, worker_id: str, role: str, nats_url: str,
                 namespace: str, model_dir: str) -> ManagedProcess:
    """`tandem worker` in the host's namespace, UCX on TCP over the host's interface only."""
    argv = [*host.exec_prefix, sys.executable, "-m", "cli.main", "worker", "--nats-url", nats_url,
            "--namespace", namespace, "--worker-id", worker_id, "--role", role, "--engine", "sim",
            "--model-dir", model_dir, "--heartbeat-interval", "0.5", "--ttl", "3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device}
    log_path = Path(launcher.log_dir) / f"{worker_id}.log"
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True, preexec_fn=die_with_parent)
    process = ManagedProcess(worker_id, argv, popen, log_path)
    launcher.processes[worker_id] = process  # stopped with the others
    return process


def prompts(vocab_size: int) -> list[list[int]]:
    return [[3 + (seed * 37 + i * 11) % (vocab_size - 3) for i in range(length)]
            for seed, length in enumerate(PROMPT_LENGTHS, start=1)]


async def test_pd_across_simulated_hosts_moves_kv_over_their_network(hosts: SimulatedHosts, tmp_path,
                                                                    tiny_model_dir: str, openai_client) -> None:
    prefill_host, decode_host = hosts.hosts["prefill"], hosts.hosts["decode"]
    nats = EmbeddedNats(str(tmp_path / "nats"), host=hosts.hub_address, command_prefix=hosts.hub_prefix).start()
    launcher = LocalLauncher(tmp_path / "logs")
    namespace = "netns" + uuid.uuid4().hex[:8]
    try:
        workers = {"p1": start_worker(launcher, prefill_host, "p1", "prefill", nats.url, namespace, tiny_model_dir),
                   "d1": start_worker(launcher, decode_host, "d1", "decode", nats.url, namespace, tiny_model_dir)}
        with reserve_port("127.0.0.1") as held:  # until the router answers
            port = held.getsockname()[1]
            router = launcher.start("router", ["router", "--nats-url", nats.url, "--namespace", namespace,
                                               "--host", "127.0.0.1", "--port", str(port), "--model-dir",
                                               tiny_model_dir, "--local-prefill-tokens", "0",
                                               "--heartbeat-interval", "0.5", "--ttl", "3"])
            router_url = f"http://127.0.0.1:{port}"
            wait_http_ok(router, router_url + "/health", START_TIMEOUT_S)
        wait_registered(nats.url, namespace, workers, START_TIMEOUT_S)
        await check_pd_answers(hosts, nats, namespace, router_url, tiny_model_dir, openai_client)
    finally:
        launcher.stop_all([["p1", "d1"], ["router"]])
        nats.stop()


async def check_pd_answers(hosts: SimulatedHosts, nats: EmbeddedNats, namespace: str, router_url: str,
                           model_dir: str, openai_client) -> None:
    prefill_host, decode_host = hosts.hosts["prefill"], hosts.hosts["decode"]
    tokenizer = Tokenizer.from_model_dir(model_dir)
    prompt_ids = prompts(tokenizer.vocab_size)
    expected = await reference(tokenizer, prompt_ids, MAX_TOKENS)
    bus = await connect(nats.url, "test-observer")
    try:
        records = await collect(bus, TransferRecord, Subjects(namespace).kv_transfers_all)
        decode_before, prefill_before = decode_host.counters(), prefill_host.counters()
        client = openai_client(router_url)
        texts = []
        for prompt in prompt_ids:
            reply = await client.completions.create(model=tokenizer.model_name, prompt=prompt,
                                                    max_tokens=MAX_TOKENS, temperature=0)
            assert reply.choices[0].finish_reason == "length"
            texts.append(reply.choices[0].text)
        assert texts == [as_router_text(tokenizer, p, e) for p, e in zip(prompt_ids, expected)], \
            "a disaggregated answer differs from the single-worker answer"

        await records_arrived(records, len(prompt_ids))
        for record in records:
            assert (record.worker_id, record.peer_worker_id, record.kind) == ("d1", "p1", "pull"), record
            assert record.outcome == "done" and record.blocks > 0 and record.blocks_ok == record.blocks, record
            assert record.recomputed_tokens == 0, record
        pulled = sum(record.bytes for record in records)
        decode_after, prefill_after = decode_host.counters(), prefill_host.counters()
        received, sent = decode_after[0] - decode_before[0], prefill_after[1] - prefill_before[1]
        assert pulled > 0 and received >= pulled and sent >= pulled, \
            f"{pulled} KV bytes pulled, but the decode host received {received} and the prefill host sent {sent}"

        # UCX's connections on the decode host (all but NATS): on its subnet address, one to
        # the prefill host's (the KV), the others its own (UCX reaching itself over TCP).
        kv_connections = [peer for peer in decode_host.tcp_peers() if peer[2] != hosts.hub_address]
        assert all(local == decode_host.address and remote in (decode_host.address, prefill_host.address)
                   for local, _, remote, _ in kv_connections), kv_connections
        assert any(remote == prefill_host.address for _, _, remote, _ in kv_connections), \
            f"no connection to the prefill host: {kv_connections}"
        print(f"KV pulled {pulled} bytes in {len(records)} transfers over {decode_host.device} "
              f"({decode_host.address} <- {prefill_host.address}); decode host received {received} bytes, "
              f"prefill host sent {sent}; connections {kv_connections}")
    finally:
        await bus.close()
