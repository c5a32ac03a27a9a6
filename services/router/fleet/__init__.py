"""The router's fleet room: the workers as this router sees them, and its link to them.

`worker_pool` mirrors membership and load and counts this router's own work in flight in
each worker's predicted-load ledger (`routing.ledger`), kept with the worker's registration,
load and view by `worker_state`; `shared_load` (pure) merges the other routers' load, which
`shared_load_link` publishes and receives over NATS; `worker_link` sends generate streams,
cancels and lease releases. Read by the flows (`flows.routing_state`, `flows.worker_wait`,
`flows.token_source`, the two-part flow) and wired by the router's assembly
(`main.RouterAssembly`). Below the flows; beside `kv`, which it never imports; above `routing`.
"""
