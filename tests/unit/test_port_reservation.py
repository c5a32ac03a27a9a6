"""A port the launcher picks for a service (port 0) stays held until the service listens:
nothing else can take it in between, and the service's own sockets bind beside the hold."""

from __future__ import annotations

import errno
import socket

import pytest

from launch.readiness import reserve_port
from services.router.main import bind_socket

HOST = "127.0.0.1"


def test_no_other_program_can_bind_a_reserved_port() -> None:
    with reserve_port(HOST) as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind((HOST, port))
        assert refused.value.errno == errno.EADDRINUSE


def test_the_metrics_collectors_socket_listens_beside_the_hold_and_gets_the_connections() -> None:
    with reserve_port(HOST) as held:
        port = held.getsockname()[1]
        with socket.create_server((HOST, port)) as service:  # as services/metrics/http_api.py binds
            with socket.create_connection((HOST, port), timeout=2):
                accepted, _ = service.accept()
                accepted.close()


@pytest.mark.parametrize("replicas", [1, 3])
def test_routers_bind_a_reserved_port_alone_or_shared(replicas: int) -> None:
    with reserve_port(HOST) as held:
        port = held.getsockname()[1]
        routers = [bind_socket(HOST, port, reuse_port=replicas > 1) for _ in range(replicas)]
        try:
            for router in routers:
                router.listen()
            with socket.create_connection((HOST, port), timeout=2):
                pass
        finally:
            for router in routers:
                router.close()


def test_the_port_is_free_again_once_released() -> None:
    with reserve_port(HOST) as held:
        port = held.getsockname()[1]
    with socket.socket() as other:
        other.bind((HOST, port))
