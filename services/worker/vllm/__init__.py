"""The vLLM engine behind Tandem's `Engine` contract (services/worker/engine.py).

`VllmEngine` runs vLLM's `AsyncLLM` in the worker process (vLLM itself starts an
EngineCore process and a model worker process under it). The worker service calls it
exactly like the sim engine. Inside:

- `options`: the typed settings (`VllmEngineOptions`, `KvConnectorOptions`), built once
  from `WorkerConfig`;
- `environment`: the one place that sets the environment variables vLLM-CPU reads;
- `engine`: `VllmEngine` (generate / abort / load / KV events / snapshot / KV transfer);
- `stats`: running totals from vLLM's stat-logger hook (load snapshots);
- `kv_event_wire`: decodes vLLM's ZMQ KV-event payloads into Tandem's events (pure);
- `kv_mirror`: the set of blocks vLLM announced, deduplicated, and its snapshot (pure);
- `kv_events`: the ZMQ subscriber bridging vLLM's publisher to the worker, with
  sequence-gap recovery through vLLM's replay socket.

KV transfer (Tandem's own vLLM KV connector; see `tandem_connector` for the picture):

- `tandem_connector`: the `KVConnectorBase_V1` vLLM loads, and the model worker's RPC
  extension; `connector_scheduler` / `connector_worker`: its two sides;
- `kv_pages`: vLLM's KV allocation as NIXL pages, checksums (pure);
- `kv_wire`: the messages crossing vLLM's process boundaries (pure);
- `kv_reports`: the report socket from vLLM's processes to the worker;
- `kv_link`: the worker's end of the connector (control requests, RPCs, reports);
- `holder`, `worker_kv`: the worker's KV data plane for vLLM (`VllmWorkerKv`, the
  counterpart of `connector.worker_kv.WorkerKv`), speaking the same NATS protocol.

`kv_event_wire`, `kv_mirror`, `kv_pages`, `kv_wire` and `kv_reports` import no vLLM, so
they are testable without it.

Install (CPU): see `requirements-cpu.txt` (pinned, installed with `--no-deps`), plus
`nixl-cu12` for KV transfer (`make install-vllm`).
"""
