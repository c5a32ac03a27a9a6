"""KV data plane: its own contracts, the transports, the lease/transfer protocol, and both
engines' data planes. Imports only `shared`; the worker service (`services/worker`) calls
it and its engines implement its ports.

- contracts: `port` (`KvPort`, `KvRegion`, `LayerHook`: what an in-process engine offers),
  `dataplane` (`DataPlane`: what the worker service calls; `LeasingDataPlane`: what both
  engines' data planes share, from a pull's source to a push's wait and receipt), `prepared` (`Prepared`: what
  both ends of a transfer name), `transport` (`KvTransport`, `TransferResult`);
- transports: `nixl_transport` over `nixl_agent` (+ `agent_types`, `descriptors`),
  `memory_transport` (workers of one process, no NIXL), `faults` (fault injection around
  either), `off_loop` (copies on a transport's own thread);
- protocol: `leases` (pure lease table), `holder` (`LeaseHolder`, answers lease requests),
  `lease_client` (`LeaseClient`, the reader's side), `block_reader` (what a reader trusts),
  `block_io` (the block-I/O port and `read_verified`), `pull` (`Pull`: one pull's state
  machine, for both engines), `puller` (the sim's driver of it: reads into a `KvPort`),
  `push` (layer-by-layer writes; the sim's writer and receiver, `PushArrival` for both), `push_ledger` (the
  writer's account of a push, both engines), `push_receipt` (the reader's end of a push,
  both engines);
- engines: `sim` (engines with an in-process `KvPort`), `vllm` (Tandem's vLLM KV connector
  and the worker's end of it).
The transfer benchmark (`tandem bench transfer`) lives in `bench.transfer`.
"""
