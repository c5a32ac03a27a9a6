"""The bus settings for a cluster: a list of URLs and the bucket replica count."""

from __future__ import annotations

import pytest

from shared.bus import connect, connect_options
from shared.config import BusConfig, ConfigError


def test_a_comma_separated_url_list_gives_every_server() -> None:
    config = BusConfig(nats_url="nats://a:4222, nats://b:4222,,nats://c:4222 ")
    assert config.nats_urls == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert connect_options(config, "test")["servers"] == config.nats_urls
    assert BusConfig().nats_urls == ["nats://127.0.0.1:4222"] and BusConfig().replicas == 1


@pytest.mark.parametrize("config", [BusConfig(nats_url=" , "), BusConfig(replicas=0), BusConfig(replicas=6)])
async def test_an_unusable_bus_config_is_refused_before_connecting(config: BusConfig) -> None:
    with pytest.raises(ConfigError):
        await connect(config, "test")
