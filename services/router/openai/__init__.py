"""The OpenAI API as the router speaks it: its models, its errors, and what a request's
fields, log-probabilities and tool calls mean, as vLLM's server reads them.

`protocol` (with `protocol_base`, `protocol_messages`, `protocol_tokenize`) holds the
request models, `protocol_answers` the response and chunk models; `request_fields` every
generate field and what Tandem does with it; `errors` the error taxonomy as OpenAI error bodies (raised by the flows too:
`BadRequest`, `TooManyRequests`); `logprobs` and `tool_calls` (with `tool_parsers`,
`tool_call_spans`) the pure translations the endpoints apply. No routes and no bus here:
the `http` room serves these models, the flows raise these errors. Imports no other room.
"""
