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
- `differences(reference, answer)`: the fields that differ, one line each.

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
    Tandem does not implement (`stop_reason`, `token_ids`, `usage.prompt_tokens_details`,
    which vLLM leaves null unless --enable-prompt-tokens-details and Tandem fills)."""

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
                                   for c in reply.choices if chat for call in c.message.tool_calls or ()))


async def streamed_answer(stream: Any) -> Answer:
    """A streamed completion or chat completion, read to its end. Several choices' chunks
    interleave as they come: each field is gathered per choice, then joined in index order."""
    models: list[str] = []
    objects: list[str] = []
    per_choice: dict[int, dict[str, list[Any]]] = {}
    usages: list[TokenCounts] = []
    async for chunk in stream:
        models.append(chunk.model)
        objects.append(chunk.object)
        if chunk.usage is not None and not chunk.choices:
            usages.append(_counts(chunk.usage))
        for choice in chunk.choices:
            own = per_choice.setdefault(choice.index, {"texts": [], "finish": [], "roles": [], "logprobs": [],
                                                       "calls": {}, "usages": []})
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
                  chunk_usages=tuple(_so_far(own["usages"]) for own in ordered if any(own["usages"])))


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


def unmet_expectations(case: ParityCase, reference: Answer) -> list[str]:
    """The case's `expect` fields that vLLM's own answer does not have."""
    return [f"{name}: expected {value!r}, vLLM answered {reference.value_of(name)!r}"
            for name, value in case.expect.items() if reference.value_of(name) != value]
