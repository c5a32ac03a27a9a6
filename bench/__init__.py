"""Tandem's benchmarks (`tandem bench ...`): they sit on top of the services and import
what they measure. Each prints one JSON document on stdout and progress on stderr; none
is a test.

- `bench.serve`: TTFT / ITL / throughput against a URL, or topologies side by side;
- `bench.routing`: KV-aware routing beside round-robin and random on a local stack;
- `bench.index`: the router's KV index beside NVIDIA Dynamo's RadixTree;
- `bench.transfer`: the KV connector's reads beside raw NIXL, and idle CPU;
- `bench.calibrate`: a real transformer's step times (PyTorch), fitted into a sim timing profile.
"""
