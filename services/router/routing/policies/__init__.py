"""The routing policies, one module each; each exports one `PolicySpec` that `registry` lists.

A new policy is a module here with a class whose `select(candidates)` answers a `Selection`
(or a `RouteRefusal`), its `PolicySpec`, and one line in `registry.POLICIES`. Beside them,
`cheapest`: the kv-aware policy's picks among the priced candidates (bounded affinity, the
home rules, ties).
"""
