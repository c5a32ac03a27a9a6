"""Prefix placement: which worker is a prefix's home, and which prefixes stay cached. Pure.

- `placement`: `Placement`, one model's placement as the routing state holds it (`Placements`:
  one per model, following membership): a snapshot per request, the plans recorded once
  committed;
- `snapshot`: `PrefixPlacement`, the read-only view of a prompt's prefix a routing request
  carries (`RouteRequest.placement`), its figures computed on first read;
- `homes`: `PrefixHomes`, per prefix its home (the worker that served it last) and its
  decayed share of the recent requests, per worker the sums of its homed prefixes' shares,
  KV and work; fed by `Placement` on each routed prompt;
- `copies`: what a popular prefix's copies, served away from its home, add to each worker;
- `residency`: once the cluster's KV cannot hold every live prefix, which ones stay resident;
  `resident_prefixes`: `ResidentPrefixes`, `PrefixHomes`' ranking of them, kept between two;
- `rules`: `HomeRules`, the home rules of one request: whether its prompt goes to its
  prefix's home, why a prefix leaves its home, and which candidate is its home; asked by
  the kv-aware policy (`policies.cheapest.Cheapest.part`) over the parts the scoring stage priced;
- `home`: where a prompt that no worker holds most of goes (its home, or a new one), picked
  among the parts by `rules`;
- `shares`: a prefix's share of the traffic and what one worker may carry of it (the share
  cap, the copies a share needs, a minor tenant, a hot prefix), for `rules` and the kv-aware
  policy.
"""
