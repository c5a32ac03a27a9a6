"""The router's request flows: from a tokenized request to its text, across the workers
it needs.

`dispatch` admits a request and opens its generation; `opener` routes each attempt
(`routing_state`: asks the KV view and the placement, lets `routing` plan, commits the plan
in the fleet's ledger, the KV predictions and the placement; `worker_wait`: while no worker
can take it), starts the plan's flow, and resumes a request whose worker was lost; `executor` runs any plan as a
`TokenSource`: one worker (`token_source.WorkerPart`) or a prefill and a decode part
(`two_part`, with the `handoff` that moves the prompt's KV: pull or push); `generation`
turns the source's token frames into text (`detokenizer`, `stop_strings`, both pure) and
one outcome, which `records` records; `spans` names each worker part in the trace.
Called by the `http` room's serving layer; below it, above `fleet`, `kv` and `openai`
(whose errors a refused request raises).
"""
