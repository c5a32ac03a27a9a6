"""Serving benchmarks: an OpenAI-compatible load client and side-by-side topology runs.

`main` is the command (`tandem bench serve`), `run` one workload's run against an endpoint
(`run_serve`, which both of its modes use); `prompts`, `stats` and `topology` are pure
(seeded workloads, figures from per-request records, topology names to worker groups);
`client` is the only module that does HTTP.
"""
