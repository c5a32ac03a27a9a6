"""The metrics collector's config (`tandem metrics`). Each field that is a flag declares it
(`shared.config_fields`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.config import (
    METRICS_AUTH_HELP,
    BusConfig,
    MembershipConfig,
    MetricsAuth,
    TracingConfig,
    check_metrics_auth,
    require,
)
from shared.config_fields import flag


class MetricsConfig(msgspec.Struct, kw_only=True, frozen=True):
    bus: BusConfig = BusConfig()
    host: Annotated[str, flag("Address to listen on.")] = "127.0.0.1"
    port: Annotated[int, flag("HTTP port; 0 picks one.", env="TANDEM_METRICS_PORT")] = 9100
    api_keys_file: Annotated[str, flag(
        "API key file (`tandem keys`) guarding the cluster page and /cluster (Bearer, or a browser's login prompt "
        "with the key as password); empty: open.", env="TANDEM_METRICS_API_KEYS_FILE")] = ""
    metrics_auth: Annotated[MetricsAuth, flag(METRICS_AUTH_HELP)] = "open"  # whether /metrics needs a key too
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        require(0 <= self.port < 65536, "port must be in [0, 65535]")
        check_metrics_auth(self.metrics_auth, self.api_keys_file)
