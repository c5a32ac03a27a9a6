"""Who asks and how urgently: a request's tenant (its API key) and priority. Pure."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PRIORITY = 0  # vLLM's: lower numbers are more urgent


@dataclass(frozen=True, slots=True)
class Tenant:
    """What admission knows of a request's sender. Without API keys every request is the
    one anonymous tenant (key ""), so the queue is first come first served within a priority."""

    key: str = ""  # the API key's name; "": no key
    weight: float = 1.0  # the key's fair-share weight: twice the weight, twice the share
    priority: int = DEFAULT_PRIORITY  # resolved (`resolve_priority`)
    tokens_per_minute: int | None = None  # the key's token budget; None: unlimited


DEFAULT_TENANT = Tenant()


def resolve_priority(requested: int | None, key_default: int | None, key_top: int | None) -> int:
    """The request's own priority (its field or header), else its key's default, else 0; never
    more urgent than the key's top priority (a lower number than `key_top` is raised to it)."""
    priority = requested if requested is not None else (key_default if key_default is not None else DEFAULT_PRIORITY)
    if key_top is not None:
        priority = max(priority, key_top)
    return priority
