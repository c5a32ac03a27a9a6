"""Routing benchmark (`tandem bench routing`): KV-aware routing beside round-robin and random
on real local stacks of sim workers.

`workloads` is pure (seeded prompts, sizing from the sim's timing profile, result figures);
`client` streams requests; `counters` reads the cluster's cache counters; `drive` runs a
workload against a stack; `main` starts one stack per (workload, policy) and prints JSON.
`main --sweep` hands over to `sweep`: a workload family (`family`) through arms (`arms`, with a
bench-only `oracle`) on systems started by `systems`, driven by `sweep_drive`, judged by `report`.
"""
