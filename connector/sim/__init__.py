"""The KV data plane of engines whose KV pool lives in the worker's own process and that
implement `connector.port.KvPort` (the sim engine): `worker_kv.WorkerKv` (the `DataPlane`),
`holder.KvHolder` (leases pinned through the port), `transport_builder.build_transport`."""
