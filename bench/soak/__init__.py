"""Soak benchmark (`tandem bench soak`): a local stack under a mixed workload for minutes,
watching for what only time shows: memory that grows, requests that fail or hang, leases,
blocks or requests left behind. Prints one JSON document (with `--json`) and a verdict.

Pure parts (`workload`, `report`) apart from I/O (`client`: HTTP requests; `rss`: /proc;
`leftovers`: load snapshots off the bus; `main`: the stack and the run).
"""
