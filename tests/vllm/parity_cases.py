"""The parity suite's requests (`tests/vllm/test_vllm_openai_parity.py`), as data: `CASES`
for completions and chat, `IMAGE_CASES` for chats with images (asked of the generated
vision-language model by `tests/vllm/test_vllm_image_chat.py`), `RESPONSES_CASES` for
`/v1/responses`, and the server flags and settings both sides are started with. One row per
request: to cover a new field, append a row; vLLM-only fields go under `extra_body`.
`expect` keyword arguments name what vLLM's own answer must show for the row to mean what
its name says."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image

from tests.vllm.parity import (
    PREVIOUS_CALL_ARGUMENTS,
    PREVIOUS_CALL_ID,
    PREVIOUS_CALL_NAME,
    ParityCase,
    ResponsesCase,
)

GREEDY = {"temperature": 0, "seed": 1234}

# The tiny model's greedy answers (random weights) decide which prompts exercise what:
FOX = "The quick brown fox jumps over the lazy dog."  # 18 tokens; " By iceatic|iff| strid| bed ..."
LONG_TEXT = " ".join([FOX] * 20)  # 2 full KV blocks (128 tokens): the decode worker pulls them
BUBBLES = " bubbles"  # one token
# Where the tiny model's greedy answer ends with EOS depends on vLLM's CPU attention kernel
# (BUBBLES': the 28th token with the vectorised one, none of the first 40 with AMX): cases
# about EOS make it the answer's 28th token on any host, with EOS (id 2) biased up and
# held back until 27 tokens are out.
EOS_BIAS = {"2": 100}
EOS_AT_28 = {"logit_bias": EOS_BIAS, "extra_body": {"min_tokens": 27}}
TOKENS = [5, 100, 200, 300, 400, 500, 600, 700, 800]  # "~~iad?oking| bo| en ..."; " bo" is id 447
LONG_TOKENS = list(range(300, 600))
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]  # " atmos?nect its... sc| Fres" (id 1201)
VERDICT = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                            "score": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["answer", "score"], "additionalProperties": False}


def completion(case_id: str, request: dict[str, Any], *, split: bool | int = True, continuous_usage: bool = False,
               streamed: bool = True, **expect: Any) -> ParityCase:
    return ParityCase(f"completion-{case_id}", "completions", {**GREEDY, **request}, expect, split, continuous_usage,
                      streamed)


def chat(case_id: str, request: dict[str, Any], *, split: bool | int = True, continuous_usage: bool = False,
         streamed: bool = True, **expect: Any) -> ParityCase:
    return ParityCase(f"chat-{case_id}", "chat", {**GREEDY, **request}, expect, split, continuous_usage, streamed)


def vllm_fields(**fields: Any) -> dict[str, Any]:
    return {"extra_body": fields}


# Tools, rendered by the tiny model's template (Hermes-style calls) on both servers; both read
# calls in the Hermes format (vLLM: --enable-auto-tool-choice --tool-call-parser hermes).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima", "Pune"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {}}}
TOOLS = [WEATHER, CLOCK]
TOOL_HISTORY = [*STORY, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "Snow, then sun."}]
VLLM_TOOL_PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
# vLLM 0.32 constrains tool calls by default with a structural tag in the model's own call
# format (xgrammar); Tandem holds a forced choice to the JSON schema vLLM used before, which
# vLLM's server still uses with this setting off.
VLLM_JSON_SCHEMA_TOOL_CALLS = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
TANDEM_TOOL_PARSER = ("--tool-call-parser", "hermes")

# Deterministic without greedy decoding: random sampling (temperature 1, no seed) whose
# filter keeps one token, so any engine picks the same one.
SAMPLED = {"temperature": 1.0, "seed": None}


CASES = [
    completion("text-max-tokens-1", {"prompt": FOX, "max_tokens": 1}, completion_tokens=1),
    completion("text-max-tokens-40", {"prompt": FOX, "max_tokens": 40}, finish_reason="length"),
    completion("long-text", {"prompt": LONG_TEXT, "max_tokens": 16}),
    completion("tokens-max-tokens-1", {"prompt": TOKENS, "max_tokens": 1}, completion_tokens=1),
    completion("tokens-max-tokens-16", {"prompt": TOKENS, "max_tokens": 16}, finish_reason="length"),
    completion("tokens-max-tokens-40", {"prompt": TOKENS, "max_tokens": 40}, finish_reason="length"),
    completion("long-tokens", {"prompt": LONG_TOKENS, "max_tokens": 16}),
    completion("eos", {"prompt": BUBBLES, "max_tokens": 40, **EOS_AT_28}, finish_reason="stop", completion_tokens=28),
    completion("ignore-eos", {"prompt": BUBBLES, "max_tokens": 40, "extra_body": {"ignore_eos": True}},
               finish_reason="length", completion_tokens=40),
    completion("stop-string-across-tokens", {"prompt": FOX, "max_tokens": 16, "stop": "iff str"},
               finish_reason="stop", text=" By iceatic"),
    completion("stop-string-list", {"prompt": FOX, "max_tokens": 16, "stop": ["no such text", " bed"]},
               finish_reason="stop"),
    chat("max-tokens-16", {"messages": STORY, "max_tokens": 16}, finish_reason="length"),
    # a message of several text parts: vLLM's server joins them with newlines for this template
    chat("text-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"},
                                                                  {"type": "text", "text": "about a fox."}]}],
                        "max_tokens": 16}),
    chat("max-completion-tokens-1", {"messages": STORY, "max_completion_tokens": 1}, completion_tokens=1),
    chat("stop-string", {"messages": STORY, "max_tokens": 16, "stop": [" Fres"]}, finish_reason="stop"),
    # The answer's last token ends with an incomplete UTF-8 character (FOX's 16th token,
    # STORY's 40th): vLLM never shows it, nor does Tandem.
    completion("text-max-tokens-16", {"prompt": FOX, "max_tokens": 16}, finish_reason="length"),
    chat("max-tokens-40", {"messages": STORY, "max_tokens": 40}, finish_reason="length"),
    # A stop token id ends the answer, its text left out (it counts as a completion token).
    completion("stop-token-ids", {"prompt": TOKENS, "max_tokens": 16, **vllm_fields(stop_token_ids=[447])},
               finish_reason="stop", completion_tokens=6),
    chat("stop-token-ids", {"messages": STORY, "max_tokens": 16, **vllm_fields(stop_token_ids=[1201])},
         finish_reason="stop"),
    # Sampling fields, through vLLM's sampler on both workers of the split.
    completion("logit-bias", {"prompt": FOX, "max_tokens": 8, "logit_bias": {"447": 100}}, text=" bo" * 8),
    chat("logit-bias", {"messages": STORY, "max_tokens": 8, "logit_bias": {"1201": 100}}, completion_tokens=8),
    completion("repetition-penalty", {"prompt": TOKENS, "max_tokens": 24, **vllm_fields(repetition_penalty=1.8)}),
    completion("min-tokens-past-eos", {"prompt": BUBBLES, "max_tokens": 40, "logit_bias": EOS_BIAS,
                                       **vllm_fields(min_tokens=34)}, finish_reason="stop", completion_tokens=35),
    completion("allowed-token-ids", {"prompt": TOKENS, "max_tokens": 12,
                                     **vllm_fields(allowed_token_ids=[447, 1201, 500, 600])}),
    # seeded: where two logits tie at the top, top_k=1 keeps both (vLLM masks what is below the
    # k-th value) and the draw decides; on an AMX host TOKENS' answer meets such a tie
    completion("top-k-1", {"prompt": TOKENS, "max_tokens": 16, **SAMPLED, "seed": 3, **vllm_fields(top_k=1)}),
    completion("min-p-1", {"prompt": FOX, "max_tokens": 16, **SAMPLED, **vllm_fields(min_p=1.0)}),
    completion("top-p-tiny", {"prompt": LONG_TOKENS, "max_tokens": 16, **SAMPLED, "top_p": 1e-6}),
    completion("skip-special-tokens-false", {"prompt": BUBBLES, "max_tokens": 40, "logit_bias": EOS_BIAS,
                                             **vllm_fields(skip_special_tokens=False, min_tokens=27)},
               finish_reason="stop"),
    # Sampling on the output history, split: the decode worker replays the first token.
    completion("presence-penalty", {"prompt": TOKENS, "max_tokens": 24, "presence_penalty": 1.5}),
    chat("frequency-penalty", {"messages": STORY, "max_tokens": 24, "frequency_penalty": 1.9}),
    completion("bad-words", {"prompt": TOKENS, "max_tokens": 16, **vllm_fields(bad_words=[" bo"])}),
    completion("seeded-sampling", {"prompt": FOX, "max_tokens": 24, "temperature": 0.9, "seed": 7}),
    # Log-probabilities of every token, computed by the worker that generated it.
    completion("logprobs-0", {"prompt": FOX, "max_tokens": 16, "logprobs": 0}),
    completion("logprobs-5", {"prompt": LONG_TOKENS, "max_tokens": 12, "logprobs": 5}),
    completion("logprobs-stop-string", {"prompt": FOX, "max_tokens": 16, "logprobs": 2, "stop": "iff str"},
               finish_reason="stop"),
    completion("logprobs-eos", {"prompt": BUBBLES, "max_tokens": 40, "logprobs": 1, **EOS_AT_28}, finish_reason="stop"),
    chat("logprobs", {"messages": STORY, "max_tokens": 16, "logprobs": True}),
    chat("top-logprobs-3", {"messages": STORY, "max_tokens": 40, "logprobs": True, "top_logprobs": 3}),
    # Echo: the prompt, and its tokens' log-probabilities (lm-evaluation-harness's log-likelihood
    # requests), computed by the one engine that computes the whole prompt.
    completion("echo", {"prompt": FOX, "max_tokens": 4, "echo": True}),
    completion("echo-logprobs-1", {"prompt": FOX, "max_tokens": 1, "echo": True, "logprobs": 1}, split=False),
    completion("echo-tokens-logprobs-3", {"prompt": LONG_TOKENS, "max_tokens": 6, "echo": True, "logprobs": 3},
               split=False),
    # vLLM's return_token_ids: the prompt's ids and each choice's generated ones (with echo the
    # echoed text is left out, as vLLM's server leaves it); the ids up to a stop string's last token.
    completion("return-token-ids", {"prompt": FOX, "max_tokens": 8, **vllm_fields(return_token_ids=True)}),
    completion("return-token-ids-echo-n-2", {"prompt": TOKENS, "max_tokens": 4, "echo": True, "n": 2, **SAMPLED,
                                             **vllm_fields(return_token_ids=True, top_k=1)}, split=2),
    completion("return-token-ids-stop-string", {"prompt": FOX, "max_tokens": 16, "stop": "iff str",
                                                **vllm_fields(return_token_ids=True)}, finish_reason="stop"),
    chat("return-token-ids", {"messages": STORY, "max_tokens": 16, "stop": [" Fres"],
                              **vllm_fields(return_token_ids=True)}, finish_reason="stop"),
    # A stop string is looked for only after min_tokens tokens (vLLM's rule): FOX's answer has
    # "iff str" in its first 8 tokens, so it runs to max_tokens.
    completion("stop-string-within-min-tokens", {"prompt": FOX, "max_tokens": 16, "stop": "iff str",
                                                 **vllm_fields(min_tokens=8)}, finish_reason="length"),
    # vLLM's include_stop_str_in_output: the answer ends after its stop string (or stop token's text).
    completion("include-stop-str", {"prompt": FOX, "max_tokens": 16, "stop": "iff str",
                                    **vllm_fields(include_stop_str_in_output=True)}, finish_reason="stop"),
    completion("include-stop-token", {"prompt": TOKENS, "max_tokens": 16,
                                      **vllm_fields(stop_token_ids=[447], include_stop_str_in_output=True)},
               finish_reason="stop", completion_tokens=6),
    # vLLM's truncate_prompt_tokens: the prompt's last tokens (its first with truncation_side
    # "right") are served; an echo shows the prompt as sent, whole (vLLM's server echoes the
    # text it was given, or the decoding of all the ids), with the served tokens' log-probabilities.
    completion("truncate-prompt-tokens", {"prompt": FOX, "max_tokens": 8,
                                          **vllm_fields(truncate_prompt_tokens=6, return_token_ids=True)}),
    completion("truncate-prompt-tokens-right", {"prompt": FOX, "max_tokens": 8, **vllm_fields(
        truncate_prompt_tokens=6, truncation_side="right", return_token_ids=True)}),
    completion("truncate-prompt-tokens-minus-one", {"prompt": TOKENS, "max_tokens": 4,
                                                    **vllm_fields(truncate_prompt_tokens=-1, return_token_ids=True)}),
    completion("truncate-prompt-tokens-echo", {"prompt": FOX, "max_tokens": 4, "echo": True,
                                               **vllm_fields(truncate_prompt_tokens=5)}),
    completion("truncate-prompt-tokens-ids-echo-logprobs", {"prompt": TOKENS, "max_tokens": 4, "echo": True,
                                                            "logprobs": 2, **vllm_fields(truncate_prompt_tokens=5)},
               split=False),
    chat("truncate-prompt-tokens", {"messages": STORY, "max_tokens": 8,
                                    **vllm_fields(truncate_prompt_tokens=7, return_token_ids=True)}),
    chat("truncate-prompt-tokens-right", {"messages": STORY, "max_tokens": 8, **vllm_fields(
        truncate_prompt_tokens=7, truncation_side="right", return_token_ids=True)}),
    # How the template renders the chat: no new assistant turn; the last (assistant) message left
    # open for the model to continue; template variables (the tiny template reads none of these)
    chat("no-generation-prompt", {"messages": STORY, "max_tokens": 8, **vllm_fields(add_generation_prompt=False)}),
    chat("continue-final-message", {"messages": [*STORY, {"role": "assistant", "content": "Once upon a time"}],
                                    "max_tokens": 8, **vllm_fields(add_generation_prompt=False,
                                                                   continue_final_message=True)}),
    chat("chat-template-kwargs", {"messages": STORY, "max_tokens": 8, **vllm_fields(
        chat_template_kwargs={"enable_thinking": False}, documents=[{"title": "Fox", "text": "A fox."}])}),
    # add_special_tokens the other way round from each endpoint's default (the tiny model's tokenizer adds none)
    completion("no-special-tokens", {"prompt": FOX, "max_tokens": 8, **vllm_fields(add_special_tokens=False)}),
    chat("special-tokens", {"messages": STORY, "max_tokens": 8, **vllm_fields(add_special_tokens=True)}),
    # vLLM's prompt_logprobs: 0 (the prompt tokens' own), which vLLM's server also takes streamed (and
    # then sends none); more top ones come with the echo cases above, whose answers carry them too
    completion("prompt-logprobs", {"prompt": FOX, "max_tokens": 4, **vllm_fields(prompt_logprobs=0)}, split=False),
    chat("prompt-logprobs", {"messages": STORY, "max_tokens": 4, **vllm_fields(prompt_logprobs=0)}, split=False),
    # more top ones than the prompt's own (refused streamed, by vLLM's server as by Tandem), alone and
    # beside an echo asking fewer (vLLM computes the larger of the two; its echo shows its dict's entries)
    completion("prompt-logprobs-3", {"prompt": FOX, "max_tokens": 4, **vllm_fields(prompt_logprobs=3)}, split=False,
               streamed=False),
    chat("prompt-logprobs-2", {"messages": STORY, "max_tokens": 4, **vllm_fields(prompt_logprobs=2)}, split=False,
         streamed=False),
    completion("echo-logprobs-1-prompt-logprobs-3", {"prompt": FOX, "max_tokens": 2, "echo": True, "logprobs": 1,
                                                     **vllm_fields(prompt_logprobs=3)}, split=False, streamed=False),
    # vLLM's cache_salt: the same answer, its KV kept apart
    completion("cache-salt", {"prompt": LONG_TEXT, "max_tokens": 8, **vllm_fields(cache_salt="tenant-a")}),
    chat("cache-salt", {"messages": STORY, "max_tokens": 8, **vllm_fields(cache_salt="tenant-b")}),
    chat("include-stop-str-logprobs", {"messages": STORY, "max_tokens": 16, "stop": [" Fres"], "logprobs": True,
                                       **vllm_fields(include_stop_str_in_output=True)}, finish_reason="stop"),
    # vLLM's return_tokens_as_token_ids: log-probabilities name tokens "token_id:<id>".
    completion("tokens-as-ids-logprobs-2", {"prompt": FOX, "max_tokens": 8, "logprobs": 2,
                                            **vllm_fields(return_tokens_as_token_ids=True)}),
    completion("tokens-as-ids-echo-logprobs-1", {"prompt": TOKENS, "max_tokens": 2, "echo": True, "logprobs": 1,
                                                 **vllm_fields(return_tokens_as_token_ids=True)}, split=False),
    chat("tokens-as-ids-top-logprobs-2", {"messages": STORY, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
                                          **vllm_fields(return_tokens_as_token_ids=True)}),
    # Several choices: n per prompt, prompts of a batch, each choice routed (and split) on its own.
    completion("n-3-top-k-1", {"prompt": FOX, "max_tokens": 8, "n": 3, **SAMPLED, **vllm_fields(top_k=1)}, split=3),
    completion("n-2-seeded", {"prompt": TOKENS, "max_tokens": 8, "n": 2, "temperature": 0.9, "seed": 5}, split=2),
    completion("batch-2", {"prompt": [FOX, BUBBLES], "max_tokens": 8}, split=2),
    completion("batch-2-n-2-logprobs", {"prompt": [TOKENS, LONG_TOKENS], "max_tokens": 5, "n": 2, "logprobs": 1,
                                        **SAMPLED, **vllm_fields(top_k=1)}, split=4),
    chat("n-2", {"messages": STORY, "max_tokens": 8, "n": 2, **SAMPLED, **vllm_fields(top_k=1)}, split=2),
    # Streamed with stream_options.continuous_usage_stats: every chunk counts its prompt's tokens
    # and its own choice's so far (compared as `parity.UsageSoFar`: chunk boundaries differ).
    completion("continuous-usage-batch-2-n-2", {"prompt": [FOX, BUBBLES], "max_tokens": 6, "n": 2, **SAMPLED,
                                                **vllm_fields(top_k=1)}, split=4, continuous_usage=True),
    chat("continuous-usage-n-2", {"messages": STORY, "max_tokens": 8, "n": 2, **SAMPLED, **vllm_fields(top_k=1)},
         split=2, continuous_usage=True),
    # Structured output, by vLLM's backend on both workers of the split (the decode worker
    # replays the first token through the grammar).
    # (both engines leave whitespace out of JSON: random weights would write it to the end)
    chat("json-schema", {"messages": STORY, "max_tokens": 32, "response_format": {
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}}, finish_reason="stop"),
    completion("structured-json", {"prompt": FOX, "max_tokens": 32, **vllm_fields(structured_outputs={
        "json": VERDICT})}, finish_reason="stop"),
    completion("json-object", {"prompt": FOX, "max_tokens": 24, **vllm_fields(response_format={"type": "json_object"})}),
    completion("regex", {"prompt": FOX, "max_tokens": 16, **vllm_fields(structured_outputs={"regex": "[a-z]{3,6}!"})},
               finish_reason="stop"),
    completion("choice", {"prompt": TOKENS, "max_tokens": 8,
                          **vllm_fields(structured_outputs={"choice": ["yes", "no", "maybe"]})},
               finish_reason="stop"),
    # Tool calling: tools in the prompt (usage counts them), calls read from the answer or
    # forced by a required or named choice (structured output, split as above).
    chat("tools-choice-none", {"messages": STORY, "max_tokens": 12, "tools": TOOLS, "tool_choice": "none"}),
    chat("tools-auto", {"messages": STORY, "max_tokens": 12, "tools": TOOLS}),
    chat("tools-history", {"messages": TOOL_HISTORY, "max_tokens": 12, "tools": TOOLS, "tool_choice": "none"}),
    chat("tools-required-one", {"messages": STORY, "max_tokens": 64, "tools": TOOLS, "tool_choice": "required",
                                "parallel_tool_calls": False}, finish_reason="tool_calls"),
    chat("tools-required", {"messages": TOOL_HISTORY, "max_tokens": 64, "tools": TOOLS, "tool_choice": "required"}),
    chat("tools-named", {"messages": STORY, "max_tokens": 48, "tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         finish_reason="stop"),
]



# Chats with images, asked of the generated vision-language model (`tandem model vision`) by
# `tests/vllm/test_vllm_image_chat.py`, whose servers serve it. Every image is random pixels
# of its own (seeds from 500: the module's other chats use lower ones), so no case shares KV
# with another.
def image_url(width: int, height: int, seed: int) -> str:
    """A PNG of random pixels as a data URL."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def image_chat(text: str, *images: tuple[int, int, int], detail: str | None = None) -> list[dict[str, Any]]:
    """One user message: an `image_url` part per (width, height, seed), then `text`."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_url(*image), **({"detail": detail} if detail else {})}}
        for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


LOOK = "What is in this picture? Answer in a few words, then say why you think so."
IGNORE_EOS = vllm_fields(ignore_eos=True)
IMAGE_CASES = [
    chat("image-one", {"messages": image_chat(LOOK, (64, 64, 500)), "max_tokens": 16, **IGNORE_EOS},
         finish_reason="length", completion_tokens=16),
    chat("image-two", {"messages": image_chat("Compare the two pictures.", (30, 100, 501), (200, 50, 502)),
                       "max_tokens": 16, **IGNORE_EOS}, finish_reason="length"),
    chat("image-detail-low", {"messages": image_chat(LOOK, (80, 60, 503), detail="low"), "max_tokens": 8,
                              **IGNORE_EOS}, finish_reason="length"),
    chat("image-max-completion-tokens-1", {"messages": image_chat(LOOK, (20, 20, 504)), "max_completion_tokens": 1},
         completion_tokens=1),
    chat("image-top-logprobs-3", {"messages": image_chat(LOOK, (64, 64, 505)), "max_tokens": 8, "logprobs": True,
                                  "top_logprobs": 3, **IGNORE_EOS}, finish_reason="length"),
    # the image in an earlier turn: the follow-up's prompt holds it (and the answer) too
    chat("image-earlier-turn", {"messages": [*image_chat(LOOK, (56, 56, 506)),
                                             {"role": "assistant", "content": "A field of coloured dots."},
                                             {"role": "user", "content": "And which colour is the most common?"}],
                                "max_tokens": 12, **IGNORE_EOS}, finish_reason="length"),
    chat("image-n-2-seeded", {"messages": image_chat(LOOK, (64, 64, 507)), "max_tokens": 8, "n": 2,
                              "temperature": 0.9, "seed": 5, **IGNORE_EOS}, split=2),
    chat("image-continuous-usage", {"messages": image_chat(LOOK, (100, 40, 508)), "max_tokens": 8,
                                    **IGNORE_EOS}, continuous_usage=True, finish_reason="length"),
]


# /v1/responses through the openai client (`responses.create`, `responses.stream`,
# `responses.retrieve`). vLLM's server keeps responses (for previous_response_id and retrieve)
# only with its store on; Tandem's router stores by default. The seed is vLLM's field.
RESPONSES_GREEDY = {"temperature": 0, "extra_body": {"seed": 1234}}
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
VLLM_RESPONSES_STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def responses(case_id: str, request: dict[str, Any], *, follow_ups: tuple[dict[str, Any], ...] = (),
              vllm_follow_ups: tuple[dict[str, Any], ...] | None = None, **expect: Any) -> ResponsesCase:
    def greedy(turns: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        return tuple({**RESPONSES_GREEDY, **turn} for turn in turns)
    return ResponsesCase(f"responses-{case_id}", {**RESPONSES_GREEDY, **request}, greedy(follow_ups), expect,
                         None if vllm_follow_ups is None else greedy(vllm_follow_ups))


STORY_TEXT = STORY[0]["content"]
FORCED_CALL = {"input": STORY_TEXT, "tools": RESPONSES_TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
               "max_output_tokens": 64}
TOOL_OUTPUT = {"input": [{"type": "function_call_output", "call_id": PREVIOUS_CALL_ID, "output": "Snow, then sun."}],
               "tools": RESPONSES_TOOLS, "max_output_tokens": 12}
RESTATED_CALL = {"type": "function_call", "call_id": PREVIOUS_CALL_ID, "name": PREVIOUS_CALL_NAME,
                 "arguments": PREVIOUS_CALL_ARGUMENTS}
RESPONSES_CASES = [
    responses("text-instructions", {"instructions": "Answer in one sentence.", "input": STORY_TEXT,
                                    "max_output_tokens": 16}, status="incomplete"),
    responses("input-messages", {"input": [*STORY, {"role": "assistant", "content": "Once upon a time"},
                                           {"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "And then?"}]}],
                                 "max_output_tokens": 24}),
    # several input_text parts: joined as chat content parts are (`chat-text-parts`)
    responses("input-parts", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me a story"}, {"type": "input_text", "text": "about a fox."}]}],
        "max_output_tokens": 16}),
    responses("tools-auto", {"input": STORY_TEXT, "tools": RESPONSES_TOOLS, "max_output_tokens": 12}),
    # truncation "auto": a conversation within the context is served whole, the response says "auto"
    responses("truncation-auto", {"input": STORY_TEXT, "truncation": "auto", "max_output_tokens": 8}),
    responses("tools-required", FORCED_CALL, output_types=("function_call",)),
    responses("json-schema", {"input": STORY_TEXT, "max_output_tokens": 32, "text": {"format": {
        "type": "json_schema", "name": "verdict", "schema": VERDICT}}}, status="completed"),
    responses("previous-response-id", {"instructions": "Answer in one sentence.", "input": STORY_TEXT,
                                       "max_output_tokens": 8},
              follow_ups=({"input": "And then?", "max_output_tokens": 8},)),
    # A function call answered by its output, the call carried on by previous_response_id
    # (restated for vLLM's server: parity.VLLM_DROPS_PREVIOUS_CALLS).
    responses("tool-output-previous-response-id", FORCED_CALL, follow_ups=(TOOL_OUTPUT,),
              vllm_follow_ups=({**TOOL_OUTPUT, "input": [RESTATED_CALL, *TOOL_OUTPUT["input"]]},),
              output_types=("function_call",)),
]
