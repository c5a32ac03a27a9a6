"""Admission: which waiting request starts next, and who is refused first. Pure and synchronous.

The router's admission gate (`services.router.flows.admission`, the adapter: futures, the
fleet's capacity) asks this package, passing the data in and acting on the answers:
- `tenant`: who asks (the API key, its fair-share weight) and how urgently: a request's
  priority from its field or header, else its key's default, bounded by the key's top
  priority (`resolve_priority`);
- `fair_share`: the keys' virtual token counters (VTC): the key served least, weighted,
  goes next; a key that becomes active starts at the least counter of the active ones;
- `queue`: `AdmissionQueue`: `push` (start, queue, or refuse), `pop` (what may start once
  a slot frees), `finish`, `withdraw`; the most urgent priority first, within it the
  fair share, within a key first come first served; sheddable requests never wait;
- `token_budget`: per-key tokens per minute, a bucket that may run into debt by one
  request and is corrected by what the request really used.

Priorities follow vLLM's convention: lower numbers are more urgent, 0 is the default.
"""

from services.router.routing.admission.fair_share import VirtualTokenCounters
from services.router.routing.admission.queue import AdmissionQueue, Ask, Pushed
from services.router.routing.admission.tenant import DEFAULT_TENANT, Tenant, resolve_priority
from services.router.routing.admission.token_budget import TokenBudgets

__all__ = ["DEFAULT_TENANT", "AdmissionQueue", "Ask", "Pushed", "Tenant", "TokenBudgets", "VirtualTokenCounters",
           "resolve_priority"]
