"""Every request field of the two generate endpoints, and what Tandem does with it. Pure.

The OpenAI API and vLLM's server (its pinned version) define the fields; each one is
- "honoured": it changes the answer as vLLM's server would (through vLLM's own sampling on
  the vllm engine; the sim engine refuses sampling fields its token model cannot honour, with
  a 400 naming them and the engine);
- "no effect": accepted, changes nothing in vLLM's server either (for example `user`);
- "refused unless default": a 400 naming the field unless it has one of `allowed` (a client
  that sends `n: 1` or `echo: false` still works); its note says why Tandem refuses it.
A field in neither endpoint's table is a 400 naming it (as OpenAI's API answers an unknown
argument), never silently ignored. `protocol` builds its request models from this table, and
the table in docs/openai-api.md is `markdown_table()` (a test keeps them equal).

Each row says who defines the field for its endpoints (`origin`): vLLM's server's request
model (OpenAI's fields it takes included), OpenAI's API alone, or Tandem itself.
tests/vllm/test_vllm_request_fields.py reads vLLM's own request models and fails, naming it,
on a field of theirs this table lacks or on a row whose origin they contradict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["honoured", "no effect", "refused unless default"]
# responses: its own table, `responses_fields`, which takes from this one only the rows naming it
Endpoint = Literal["completions", "chat", "responses"]
# who defines the field for the row's endpoints: vLLM's server (its request model; OpenAI's
# fields it takes included), OpenAI's API alone, or Tandem (its own extension or refusal)
Origin = Literal["vllm", "openai", "tandem"]
BOTH: tuple[Endpoint, ...] = ("completions", "chat")
# vLLM's extensions its Responses API takes too, refused there for the same reason: one row each
EVERY: tuple[Endpoint, ...] = (*BOTH, "responses")


@dataclass(frozen=True)
class RequestField:
    name: str
    status: Status
    endpoints: tuple[Endpoint, ...] = BOTH
    allowed: tuple[object, ...] = (None,)  # refused unless default: the values accepted
    note: str = ""  # refused unless default: why Tandem refuses it
    origin: Origin = "vllm"


_HONOURED = [
    RequestField("model", "honoured"),
    RequestField("prompt", "honoured", ("completions",), note="a string, token ids, or a batch of either "
                                                                "(each prompt routed on its own, answered in order)"),
    RequestField("n", "honoured", note="choices per prompt, each routed on its own (seeded: seed + i)"),
    RequestField("messages", "honoured", ("chat",), note="text content, past tool calls and tool answers; "
                                                        "the model's chat template"),
    RequestField("max_tokens", "honoured"),
    RequestField("max_completion_tokens", "honoured", ("chat",)),
    RequestField("temperature", "honoured"),
    RequestField("top_p", "honoured"),
    RequestField("top_k", "honoured"),
    RequestField("min_p", "honoured"),
    RequestField("seed", "honoured", note="seeded random sampling; split, the decode worker replays the first token"),
    RequestField("stop", "honoured"),
    RequestField("stop_token_ids", "honoured", note="ids of the model's vocabulary; any other (negative too) is a "
                                                    "400, as on vLLM's server"),
    RequestField("ignore_eos", "honoured"),
    RequestField("min_tokens", "honoured"),
    RequestField("presence_penalty", "honoured", note="split, the decode worker replays the first token"),
    RequestField("frequency_penalty", "honoured", note="split, the decode worker replays the first token"),
    RequestField("repetition_penalty", "honoured"),
    RequestField("logit_bias", "honoured", note="token id (as a string) to a bias in [-100, 100]"),
    RequestField("bad_words", "honoured", note="split, the decode worker replays the first token"),
    RequestField("allowed_token_ids", "honoured"),
    RequestField("skip_special_tokens", "honoured"),
    RequestField("response_format", "honoured", note="text, json_object, json_schema: vLLM's structured output "
                                                     "(split: the decode worker replays the first token)"),
    RequestField("structured_outputs", "honoured", note="vLLM's: json, json_object, regex, choice or grammar "
                                                        "(disable_any_whitespace: a worker setting)"),
    RequestField("logprobs", "honoured", note="completions: how many top ones (0-20); chat: true or false"),
    RequestField("top_logprobs", "honoured", ("chat",), note="0-20, with logprobs: true"),
    RequestField("echo", "honoured", ("completions",), note="with logprobs, the prompt's log-probabilities too; "
                                                              "runs on one engine, computing the whole prompt"),
    RequestField("tools", "honoured", ("chat",), note="functions, rendered by the model's chat template"),
    RequestField("tool_choice", "honoured", ("chat",), note="none, auto (needs the router's --tool-call-parser), "
                                                           "required or a named function (held to a JSON schema)"),
    RequestField("parallel_tool_calls", "honoured", ("chat",), note="false: at most one call"),
    RequestField("prompt_logprobs", "honoured", note="0-20: each prompt token's log-probability with this many "
                                                     "top ones (not streamed; a completion echoed with logprobs "
                                                     "has them too); computed where the whole prompt is"),
    RequestField("add_special_tokens", "honoured", note="completions: true (the default) adds BOS where the "
                                                        "model's tokenizer adds one; chats: false (the default), "
                                                        "only the special tokens the template writes"),
    RequestField("add_generation_prompt", "honoured", ("chat",), note="false: the prompt ends after the last "
                                                                     "message, with no new assistant turn"),
    RequestField("continue_final_message", "honoured", ("chat",), note="the last message is left open (the "
                                                                      "prompt ends with its content) for the "
                                                                      "model to continue"),
    RequestField("chat_template_kwargs", "honoured", ("chat",), note="variables of the model's chat template "
                                                                    "(ones it does not use change nothing)"),
    RequestField("documents", "honoured", ("chat",), note="the chat template's `documents` variable"),
    RequestField("stream", "honoured"),
    RequestField("stream_options", "honoured", note="include_usage: a last chunk with the usage; "
                                                    "continuous_usage_stats (vLLM's), with it: every chunk "
                                                    "carries its choice's usage so far"),
    RequestField("priority", "honoured", note="lower is served first (vLLM's convention, 0 the default) by the "
                                              "router's admission queue (`--admission-slots-per-seq`); also the "
                                              "X-Tandem-Priority header; bounded by the API key's top priority"),
    RequestField("return_token_ids", "honoured", note="the prompt's token ids (streamed: in the first chunk) and "
                                                      "each choice's generated ones (streamed: each chunk's); with "
                                                      "echo, the echoed prompt's text is left out, and a streamed "
                                                      "echo names the prompt's ids even without it, as vLLM's "
                                                      "server does"),
    RequestField("return_tokens_as_token_ids", "honoured", note="with logprobs: tokens named `token_id:<id>` (a "
                                                                "chat position's own bytes stay its text's, as on "
                                                                "vLLM's server)"),
    RequestField("truncate_prompt_tokens", "honoured", note="a longer prompt keeps this many tokens, its last "
                                                            "ones (-1: the context length, less one where output "
                                                            "is asked); a completion's BOS stays unless a side is "
                                                            "named; not with images"),
    RequestField("cache_salt", "honoured", note="the prompt's KV (the router's index, the engine's prefix cache, "
                                                "KV transfers) is shared only with requests of the same salt"),
    RequestField("truncation_side", "honoured", note="with truncate_prompt_tokens: left keeps the last tokens, "
                                                     "right the first"),
    RequestField("include_stop_str_in_output", "honoured", note="the answer ends after the stop string (or a "
                                                                "stop token's text) instead of before it"),
    RequestField("cache_hit_threshold", "honoured", note="Tandem's: serve only from a worker holding this "
                                                         "share of the prompt's KV", origin="tandem"),
]

_NO_EFFECT = [
    RequestField("user", "no effect", note="an end-user id for the client's own records"),
]


def _refused(name: str, *allowed: object, why: str, endpoints: tuple[Endpoint, ...] = BOTH,
             origin: Origin = "vllm") -> RequestField:
    return RequestField(name, "refused unless default", endpoints, allowed or (None,), why, origin)


_NO_REASONING = "no reasoning parser in the router: an answer is never split into reasoning and content"
_DEFAULT_IMAGE_PROCESSING = ("the router places each image's tokens as the model's processor does by default: "
                             "other settings would place them otherwise")
_RENDER_ONLY = "vLLM's server reads it only on its render endpoints, which Tandem does not serve"
_NO_BEAM_SEARCH = "beam search is not implemented (each choice is routed and sampled on its own)"

_REFUSED = [
    _refused("best_of", None, 1, endpoints=("completions",), origin="openai",
             why="OpenAI's; vLLM's server (0.32) no longer has it"),
    _refused("echo", None, False, endpoints=("chat",), why="not implemented for chats (a completion's echo is)"),
    _refused("suffix", None, endpoints=("completions",), why="vLLM's server refuses it too"),
    _refused("tools", None, [], endpoints=("completions",), origin="tandem", why="tool calls are a chat's"),
    _refused("reasoning_effort", None, endpoints=("chat",), why=_NO_REASONING),
    _refused("include_reasoning", None, True, endpoints=("chat",), why=_NO_REASONING),
    _refused("chat_template", None, endpoints=("chat",),
             why="the router renders only the model's own chat template, never a request's"),
    _refused("media_io_kwargs", None, endpoints=("chat",), why=_DEFAULT_IMAGE_PROCESSING),
    _refused("mm_processor_kwargs", None, endpoints=("chat",), why=_DEFAULT_IMAGE_PROCESSING),
    _refused("return_prompt_text", None, False, endpoints=("chat",), why="not implemented"),
    _refused("prompt_embeds", None, endpoints=("completions",),
             why="prompts are text or token ids: the router routes and moves KV by token ids"),
    _refused("use_beam_search", None, False, why=_NO_BEAM_SEARCH),
    _refused("length_penalty", None, 1.0, why=_NO_BEAM_SEARCH),
    _refused("spaces_between_special_tokens", None, True, why="the router's detokenizer has only vLLM's default"),
    _refused("logprob_token_ids", None, why="not implemented: the sampled and top tokens' log-probabilities only"),
    _refused("watermarking", None, endpoints=EVERY, why="not implemented by Tandem's workers"),
    _refused("repetition_detection", None, why="not implemented by Tandem's workers"),
    _refused("thinking_token_budget", None, why=_NO_REASONING),
    _refused("request_id", None, why="the router names each request itself (the answer's id)"),
    _refused("session_id", None, endpoints=EVERY, why="not implemented: requests are routed by their prompt's KV"),
    _refused("return_token_offsets", None, False, why=_RENDER_ONLY),
    _refused("routed_experts_prompt_start", None, why="not implemented: answers carry no routed-expert data"),
    _refused("mm_payload", None, why=_RENDER_ONLY),
    _refused("return_mm_kwargs", None, False, why=_RENDER_ONLY),
    _refused("kv_transfer_params", None, endpoints=EVERY,
             why="the router plans every prefill/decode split and KV transfer itself"),
    _refused("ec_transfer_params", None, endpoints=EVERY,
             why="the workers share the vision encoder's output themselves (--vllm-encoder-cache-dir)"),
    _refused("vllm_xargs", None, endpoints=EVERY, why="not passed on: Tandem's workers run no custom logits processors"),
    _refused("stream_interval", None, 1, why="each piece is streamed as it comes (pieces already there together)"),
]

FIELDS: tuple[RequestField, ...] = (*_HONOURED, *_NO_EFFECT, *_REFUSED)


def fields_of(endpoint: Endpoint, status: Status | None = None) -> dict[str, RequestField]:
    """The endpoint's fields by name (of one status, when given)."""
    return {field.name: field for field in FIELDS
            if endpoint in field.endpoints and (status is None or field.status == status)}


def _allowed_text(field: RequestField) -> str:
    import json

    return ", ".join("absent" if value is None else json.dumps(value) for value in field.allowed)


def markdown_table() -> str:
    """The table docs/openai-api.md shows: one row per field and endpoint set."""
    rows = ["| field | completions | chat | status | note |", "|---|---|---|---|---|"]
    for field in sorted(FIELDS, key=lambda field: (field.status != "honoured", field.status, field.name)):
        note = field.note
        if field.status == "refused unless default":
            note = "; ".join(part for part in (f"accepted: {_allowed_text(field)}", note) if part)
        marks = ["yes" if endpoint in field.endpoints else "" for endpoint in BOTH]
        rows.append(f"| `{field.name}` | {marks[0]} | {marks[1]} | {field.status} | {note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
