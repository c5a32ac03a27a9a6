"""What a generate request says beyond its body: the headers the router reads and the API key
it was let in with (`auth.middleware` leaves it in the ASGI scope).

- `X-Tandem-Worker`: a worker id, the pinned routing policy's hint;
- `X-Tandem-Priority`: the request's priority when its body names none (vLLM's `priority`
  field; lower is more urgent, 0 the default), bounded by its key's `top_priority`.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Scope

from services.router.openai.errors import BadRequest
from services.router.routing.admission import Tenant, resolve_priority
from shared.api_keys import ApiKey

ROUTE_HINT_HEADER = "x-tandem-worker"  # a worker id, or "p>d" (a pair); only the pinned routing policy reads it
PRIORITY_HEADER = "x-tandem-priority"
API_KEY_SCOPE = "tandem.api_key"  # the scope's entry for the request's `ApiKey` (absent: the API is open)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_ROUTE_HINT, _PRIORITY = ROUTE_HINT_HEADER.encode(), PRIORITY_HEADER.encode()


@dataclass(frozen=True)
class Caller:
    route_hint: str | None = None
    priority: int | None = None  # the header's
    api_key: ApiKey | None = None

    def tenant(self, body_priority: int | None) -> Tenant:
        """Who asks, and how urgently: the body's priority, else the header's, else the key's default."""
        requested = body_priority if body_priority is not None else self.priority
        key = self.api_key
        if key is None:
            return Tenant(priority=resolve_priority(requested, None, None))
        return Tenant(key=key.name, weight=key.weight if key.weight is not None else 1.0,
                      priority=resolve_priority(requested, key.priority, key.top_priority),
                      tokens_per_minute=key.tpm)


def caller_of(scope: Scope) -> Caller:
    """The caller of an HTTP request's scope; a malformed priority header is a 400."""
    hint = priority = None
    for name, value in scope["headers"]:
        if name == _ROUTE_HINT:
            hint = value.decode("latin-1") or None
        elif name == _PRIORITY:
            priority = _priority(value.decode("latin-1"))
    return Caller(route_hint=hint, priority=priority, api_key=scope.get(API_KEY_SCOPE))


def _priority(text: str) -> int:
    try:
        priority = int(text.strip())
    except ValueError:
        raise BadRequest(f"the {PRIORITY_HEADER} header must be an integer", param=PRIORITY_HEADER) from None
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise BadRequest(f"the {PRIORITY_HEADER} header must lie in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]",
                         param=PRIORITY_HEADER)
    return priority
