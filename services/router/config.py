"""The router's config (`tandem router`): its HTTP front door (`RouterConfig`), admission,
scale from zero and stored responses. How it picks a request's workers is the routing
library's own config (`services.router.routing.config.RoutingConfig`), nested here. Each
field that is a flag declares it (`shared.config_fields`); adding a knob is adding a field.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.router.routing.config import AdmissionConfig, RoutingConfig, ScaleFromZeroConfig
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
from shared.schemas.generate import ACCEPT_HOLD_S


class ResponsesConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The Responses API's stored responses (`services.router.flows.responses_store`): kept for
    `ttl_s`, at most `max_bytes` of them (past that the oldest go first)."""

    store: Annotated[Literal["jetstream", "memory"], flag(
        "Where /v1/responses keeps stored responses: jetstream (a NATS key-value bucket every router replica "
        "reads) or memory (this router alone).", name="--responses-store")] = "jetstream"
    ttl_s: Annotated[float, flag("Seconds a stored response is kept (retrieve, previous_response_id).",
                                 name="--responses-ttl")] = 86400.0
    max_bytes: Annotated[int, flag("Most bytes of stored responses kept; past it the oldest are dropped first.",
                                   name="--responses-max-bytes")] = 64 * 2**20
    # one stored response with its conversation; a larger one is answered but not stored (logged),
    # and never more than the NATS server's max payload
    max_record_bytes: int = 2**20

    def validate(self) -> None:
        require(self.store in ("jetstream", "memory"), "responses store must be jetstream or memory")
        require(self.ttl_s > 0, "responses ttl must be positive")
        require(0 < self.max_record_bytes <= self.max_bytes, "responses max_record_bytes must lie in (0, max_bytes]")


# The ways of writing tool calls in an answer the router reads (services.router.openai.tool_parsers).
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")


class RouterConfig(msgspec.Struct, kw_only=True, frozen=True):
    bus: BusConfig = BusConfig()
    host: Annotated[str, flag("Address to listen on.", env="TANDEM_HOST")] = "127.0.0.1"
    port: Annotated[int, flag("HTTP port; 0 picks a free one.", env="TANDEM_PORT")] = 8000
    # several routers on one port (SO_REUSEPORT, Linux): the kernel spreads connections over them
    reuse_port: Annotated[bool, flag("Share the port with other routers of the cluster (SO_REUSEPORT, Linux).")] = \
        False
    instance_port: Annotated[int | None, flag(
        "Also listen on this port, this router alone (health checks of one replica); 0 picks one.")] = None
    # the router's own model: served with no worker up; every other model its workers register is
    # served with the tokenizer of the model directory they register (`http.served_models`)
    model_dir: Annotated[str, flag(
        "The router's own model directory (tokenizer, chat template); the other models its workers register come "
        "with theirs.", env="TANDEM_MODEL_DIR")] = ""
    served_model_name: Annotated[str, flag("The router's own model's name in the API; empty: the tokenizer's.")] = ""
    max_tokens_limit: Annotated[int, flag("Largest max_tokens a request may ask for.")] = 4096
    default_max_tokens: int = 16
    accept_timeout_s: float = 2.0
    idle_timeout_s: float = 60.0
    worker_wait_s: float = 5.0  # how long a request waits for a worker to appear
    max_attempts: int = 3  # workers one request may be sent to (refused, lost, resumed mid-stream)
    routing: RoutingConfig = RoutingConfig()
    admission: AdmissionConfig = AdmissionConfig()
    scale_from_zero: ScaleFromZeroConfig = ScaleFromZeroConfig()
    responses: ResponsesConfig = ResponsesConfig()
    tool_call_parser: Annotated[str, flag(  # one of TOOL_CALL_FORMATS
        "How the model writes tool calls (hermes, llama3_json, mistral): lets chats use tool_choice auto, with "
        "the calls read from the answer. Empty: tool_choice auto is refused.")] = ""
    image_url_hosts: Annotated[tuple[str, ...], flag(
        "A host whose http(s) image URLs chats may name: the router fetches them (repeat). None: chats send images "
        "as data URLs.", name="--image-url-host")] = ()
    image_url_timeout_s: Annotated[float, flag("The longest one image URL's fetch may take.")] = 5.0
    verify_kv_hashes: Annotated[bool, flag(
        "Recompute the chain hash of every block workers announce from its token ids, index that one, and count "
        "the blocks whose sent hash differs (tandem_router_kv_hash_mismatch_blocks_total); slower ingest, for "
        "checking a worker's hashing.")] = False
    api_keys_file: Annotated[str, flag(  # a key file (`shared.api_keys`)
        "API key file (`tandem keys create`): /v1/* needs `Authorization: Bearer <key>`; reloaded when it "
        "changes. Empty: the API is open.", env="TANDEM_API_KEYS_FILE",
        doc="See [Authentication](security.md#authentication).")] = ""
    metrics_auth: Annotated[MetricsAuth, flag(METRICS_AUTH_HELP)] = "open"  # whether /metrics needs a key too
    membership: MembershipConfig = MembershipConfig()
    tracing: TracingConfig = TracingConfig()

    def validate(self) -> None:
        require(0 <= self.port < 65536, "port must be in [0, 65535]")
        require(self.instance_port is None or 0 <= self.instance_port < 65536, "instance port must be in [0, 65535]")
        require(not self.reuse_port or self.port > 0, "routers sharing a port need that port (not 0)")
        require(self.max_tokens_limit > 0, "max_tokens_limit must be positive")
        require(self.accept_timeout_s > 0 and self.idle_timeout_s > 0, "timeouts must be positive")
        require(self.accept_timeout_s > 2 * ACCEPT_HOLD_S,
                f"the accept timeout must be longer than twice a worker's hold of Accepted ({ACCEPT_HOLD_S} s)")
        require(self.max_attempts >= 1, "max_attempts must be at least 1")
        require(self.image_url_timeout_s > 0, "image_url_timeout_s must be positive")
        require(self.tool_call_parser in ("", *TOOL_CALL_FORMATS),
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)} (or empty)")
        check_metrics_auth(self.metrics_auth, self.api_keys_file)
        self.routing.validate()
        self.admission.validate()
        self.scale_from_zero.validate()
        self.responses.validate()
