"""Prefix placement: which worker is a prefix's home, and which prefixes stay cached. Pure.

- `homes`: `PrefixHomes`, per prefix its home (the worker that served it last) and its
  decayed share of the recent requests, per worker the sums of its homed prefixes' shares,
  KV and work; fed by the router's KV view (`kv.view`) on each routed prompt;
- `home_views`: the views of it a routing request carries, computed on access;
- `copies`: what a popular prefix's copies, served away from its home, add to each worker;
- `residency`: once the cluster's KV cannot hold every live prefix, which ones stay resident;
- `home`: where a prompt that no worker holds most of goes (its home, or a new one), read
  by the cost model (`candidates.Candidates`).
"""
