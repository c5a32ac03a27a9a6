"""Router replicas in the launcher and the router's sockets: a definition's router count,
`tandem up --routers`, the replicas' names, and several routers binding one port."""

from __future__ import annotations

import socket

import pytest

from launch.definition import (
    DefinitionError,
    default_definition_path,
    load_definition,
    parse_definition,
    with_overrides,
)
from launch.plan import plan_stack
from launch.stack import router_names
from services.router.config import RouterConfig
from services.router.main import bind_socket
from shared.config import ConfigError

WORKERS = [{"name": "worker", "role": "both", "count": 1}]


def test_a_definition_says_how_many_routers_and_tandem_up_overrides_it() -> None:
    assert load_definition(default_definition_path()).routers == 1
    definition = parse_definition({"routers": 3, "workers": WORKERS})
    assert definition.routers == 3
    assert with_overrides(definition, routers=2).routers == 2
    assert with_overrides(definition).routers == 3  # None keeps the definition's
    planned = plan_stack(with_overrides(definition, routers=2, model_dir="/m"), log_dir="/tmp/logs")
    assert planned.routers == 2
    with pytest.raises(DefinitionError, match="routers: at least one router"):
        parse_definition({"routers": 0, "workers": WORKERS})


def test_replicas_are_named_after_the_router() -> None:
    assert router_names(1) == ["router"]
    assert router_names(3) == ["router", "router-2", "router-3"]


def test_routers_sharing_a_port_need_that_port() -> None:
    with pytest.raises(ConfigError, match="sharing a port"):
        RouterConfig(port=0, reuse_port=True).validate()
    with pytest.raises(ConfigError, match="instance port"):
        RouterConfig(instance_port=70000).validate()
    RouterConfig(port=8123, reuse_port=True, instance_port=0).validate()


def test_several_routers_bind_one_port_only_with_reuse_port() -> None:
    first = bind_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    sockets = [first]
    try:
        sockets.append(bind_socket("127.0.0.1", port, reuse_port=True))
        for sock in sockets:
            sock.listen()
        with pytest.raises(ConfigError, match="cannot bind"):
            bind_socket("127.0.0.1", port)  # a router that does not share
        # both listen: connections are spread over them by the kernel
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        accepted: list[list[socket.socket]] = [[] for _ in sockets]
        for sock, into in zip(sockets, accepted):
            sock.setblocking(False)
            while True:
                try:
                    into.append(sock.accept()[0])
                except BlockingIOError:
                    break
        assert sum(map(len, accepted)) == 32 and min(map(len, accepted)) > 0, [len(a) for a in accepted]
        for connection in (*clients, *(conn for into in accepted for conn in into)):
            connection.close()
    finally:
        for sock in sockets:
            sock.close()
