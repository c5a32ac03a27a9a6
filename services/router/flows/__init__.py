"""The router's request flows: from a tokenized request to its text, across the workers
it needs.

`dispatch` routes a request (asks `kv.view`, lets `routing` plan, commits the plan in the
fleet's ledger) and resumes one whose worker was lost; `executor` runs any plan as a
`TokenSource`: one worker (`token_source.WorkerPart`) or a prefill and a decode part
(`two_part`, with the `handoff` that moves the prompt's KV: pull or push); `generation`
turns the source's token frames into text (`detokenizer`, `stop_strings`, both pure) and
one outcome, which `records` records; `spans` names each worker part in the trace.
Called by the `http` room's serving layer; below it, above `fleet`, `kv` and `openai`
(whose errors a refused request raises).
"""
