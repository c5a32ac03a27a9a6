"""The KV data plane of a vLLM engine: Tandem's own vLLM KV connector and the worker's end.

The engine (`services/worker/vllm/engine.py`) implements this package's port,
`engine_port.VllmKvEngine`; the worker service calls `worker_kv.VllmWorkerKv` through
`connector.dataplane.DataPlane`, like the sim's data plane. See `tandem_connector` for the
picture of vLLM's processes.

- `tandem_connector`: the `KVConnectorBase_V1` vLLM loads (`kv_connector_module_path`),
  and the model worker's RPC extension; `connector_scheduler` / `connector_worker`: its
  two sides; `connector_push`: the worker side's layer-by-layer push writes;
  `host_scheduler`: a host-memory tier behind vLLM's cache, its scheduler half, over
  `host_slots` (which host slot holds which block, pure); `scheduled_blocks`: each
  scheduled request's blocks from vLLM's scheduler output (pushes and host saves);
- `settings`: the connector's settings (`KvConnectorOptions`), pure data;
- `kv_pages`: vLLM's KV allocation as NIXL pages, checksums (pure);
- `kv_wire`: the messages crossing vLLM's process boundaries (pure);
- `kv_reports`: the report socket from vLLM's processes to the worker;
- `kv_link`: the worker's end of the connector (control requests, RPCs, reports);
- `engine_port`: what the data plane asks of the vLLM engine;
- `holder`, `worker_kv`: the worker's KV data plane for vLLM (`VllmKvHolder`,
  `VllmWorkerKv`), speaking the same NATS protocol as the sim's, with the same
  `connector.lease_client.LeaseClient`, `connector.block_reader` and `connector.faults`;
  `push`: its push mode (reader and writer, the sim's `PushTarget` / `PushDone` protocol).

`settings`, `kv_pages`, `kv_wire`, `kv_reports`, `host_slots` and `engine_port` import no
vLLM, so they are testable without it.
"""
