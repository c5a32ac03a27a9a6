"""Base classes shared by all schemas."""

import msgspec

SCHEMA_VERSION = 1


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A top-level message. `v` lets a consumer refuse a schema it does not know."""

    v: int = SCHEMA_VERSION
