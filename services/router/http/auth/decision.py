"""Whether a request may pass, pure: the key it presents looked up in the table, then the
key's limits (`KeyLimiter`, which counts the request in flight when it passes).

Refusals are values: `Denial` with the HTTP status, a message for the client, the header
the answer needs (`WWW-Authenticate` on 401, `Retry-After` on 429), and the outcome
metrics count. The message never repeats what the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.http.auth.limits import KeyLimiter, Outcome
from shared.api_keys import ApiKey, KeyTable, presented_key

MISSING, INVALID = "missing_key", "invalid_key"


@dataclass(frozen=True, slots=True)
class Denial:
    status: int  # 401 or 429
    code: str  # the OpenAI error body's code, and the outcome counted
    message: str
    headers: dict[str, str]
    key_name: str = ""  # the key, when one was recognised (429)


@dataclass(frozen=True, slots=True)
class Granted:
    key: ApiKey


def authenticate(table: KeyTable, authorization: str | None) -> ApiKey | Denial:
    presented = presented_key(authorization)
    challenge = {"WWW-Authenticate": 'Bearer realm="tandem"'}
    if presented is None:
        return Denial(401, MISSING, "Missing API key: send `Authorization: Bearer <key>`.", challenge)
    key = table.lookup(presented)
    if key is None:
        return Denial(401, INVALID, "Incorrect API key provided.",
                      {"WWW-Authenticate": 'Bearer realm="tandem", error="invalid_token"'})
    return key


def authorize(table: KeyTable, limiter: KeyLimiter, authorization: str | None, now: float) -> Granted | Denial:
    """Look the key up, then admit it under its limits. A `Granted` request holds a
    concurrency slot: the caller releases it (`limiter.release(key.name)`) once answered."""
    key = authenticate(table, authorization)
    if isinstance(key, Denial):
        return key
    admission = limiter.admit(key, now)
    if admission.accepted:
        return Granted(key)
    retry = {"Retry-After": str(admission.retry_after_s)}
    if admission.outcome is Outcome.CONCURRENCY_LIMITED:
        return Denial(429, admission.outcome.value,
                      f"Too many concurrent requests for API key '{key.name}' (at most {key.max_concurrent}).",
                      retry, key.name)
    return Denial(429, admission.outcome.value,
                  f"Rate limit reached for API key '{key.name}' ({key.limits_text()}).", retry, key.name)
