"""Simulated hosts: Linux network namespaces on a private subnet, made by a test and deleted
afterwards, also when the test fails. Needs root and iproute2's `ip`.

```
  root namespace (the test, the router)
      | veth  10.X.1.1 <-> 10.X.1.2
  hub namespace: a bridge 10.X.2.1, NATS listening on 10.X.1.2
      | veth       | veth
  host "a"       host "b"        10.X.2.11, 10.X.2.12, ... (each: its own namespace, one interface)
```

The bridge lives in the hub, a namespace of the test's own, so the root namespace's firewall
(a FORWARD policy of DROP, with bridged traffic passed to it) never sees the hosts' traffic.
Hosts reach the hub's address 10.X.1.2 through the bridge (a route each); no packet is
forwarded anywhere. X is picked at random among private subnets this machine does not use.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from launch.process import start_or_undo


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class SimulatedHost:
    name: str
    namespace: str
    device: str  # its one interface on the hosts' subnet
    address: str

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Runs a command in this host's namespace."""
        return ("ip", "netns", "exec", self.namespace)

    def counters(self) -> tuple[int, int]:
        """Bytes received and sent on its interface so far."""
        stats = json.loads(ip("-n", self.namespace, "-j", "-s", "link", "show", "dev", self.device))[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def tcp_peers(self) -> list[tuple[str, int, str, int]]:
        """Its established TCP connections: (local address, port, peer address, port)."""
        out = subprocess.run([*self.exec_prefix, "ss", "-Htn", "state", "established"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        peers = []
        for line in out.splitlines():
            fields = line.split()
            local, peer = fields[-2], fields[-1]
            peers.append((local.rsplit(":", 1)[0], int(local.rsplit(":", 1)[1]),
                          peer.rsplit(":", 1)[0], int(peer.rsplit(":", 1)[1])))
        return peers


def _free_subnet_octet() -> int:
    used = ip("-j", "addr") + ip("-j", "route")
    candidates = [octet for octet in range(200, 250) if f'"10.{octet}.' not in used]
    if not candidates:
        raise RuntimeError("no free 10.X.0.0/16 subnet for the simulated hosts")
    return random.choice(candidates)


class SimulatedHosts:
    """The hub and one namespace per name in `names`; a context manager."""

    def __init__(self, names: Sequence[str]) -> None:
        self.tag = "tmh" + uuid.uuid4().hex[:4]  # interface names stay under 15 characters
        self.octet = _free_subnet_octet()
        self.hub_namespace = f"{self.tag}-hub"
        self.hub_address = f"10.{self.octet}.1.2"  # NATS listens here
        self.root_device = f"{self.tag}r"
        self.names = list(names)
        self.hosts: dict[str, SimulatedHost] = {}
        self._namespaces: list[str] = []

    @property
    def hub_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.hub_namespace)

    def __enter__(self) -> SimulatedHosts:
        start_or_undo(self._create, self.delete)
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def _namespace(self, name: str) -> str:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def _create(self) -> None:
        hub, net = self._namespace(self.hub_namespace), f"10.{self.octet}"
        ip("link", "add", self.root_device, "type", "veth", "peer", "name", f"{self.tag}h")
        ip("link", "set", f"{self.tag}h", "netns", hub)
        ip("addr", "add", f"{net}.1.1/24", "dev", self.root_device)
        ip("link", "set", self.root_device, "up")
        ip("-n", hub, "addr", "add", f"{self.hub_address}/24", "dev", f"{self.tag}h")
        ip("-n", hub, "link", "set", f"{self.tag}h", "up")
        bridge = f"{self.tag}br"
        ip("-n", hub, "link", "add", bridge, "type", "bridge")
        ip("-n", hub, "addr", "add", f"{net}.2.1/24", "dev", bridge)
        ip("-n", hub, "link", "set", bridge, "up")
        for index, name in enumerate(self.names):
            namespace = self._namespace(f"{self.tag}-{name}")
            device, port = f"{self.tag}e{index}", f"{self.tag}p{index}"
            address = f"{net}.2.{11 + index}"
            ip("link", "add", port, "type", "veth", "peer", "name", device)
            ip("link", "set", port, "netns", hub)
            ip("link", "set", device, "netns", namespace)
            ip("-n", hub, "link", "set", port, "master", bridge)
            ip("-n", hub, "link", "set", port, "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            ip("-n", namespace, "link", "set", device, "up")
            ip("-n", namespace, "route", "add", f"{net}.1.0/24", "via", f"{net}.2.1")
            self.hosts[name] = SimulatedHost(name=name, namespace=namespace, device=device, address=address)

    def delete(self) -> None:
        """Everything made here: deleting a namespace deletes the interfaces in it, and a
        veth goes with its peer. Stop the processes in the namespaces first."""
        for namespace in reversed(self._namespaces):
            ip("netns", "del", namespace, check=False)
        ip("link", "del", self.root_device, check=False)
        self._namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces or interfaces of these hosts still present (none after `delete`)."""
        namespaces = [line.split()[0] for line in ip("netns", "list").splitlines() if line.startswith(self.tag)]
        links = [link["ifname"] for link in json.loads(ip("-j", "link")) if link["ifname"].startswith(self.tag)]
        return namespaces + links
