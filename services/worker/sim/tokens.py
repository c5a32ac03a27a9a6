"""Deterministic token generation for the sim: the next token is a function of the history.

The history (prompt + tokens generated so far) is folded into a rolling 64-bit state, one
token at a time, so any worker can recompute it from token ids alone: a decode worker that
receives a prompt prefilled elsewhere continues exactly as a worker that prefilled it
itself would. Greedy requests (temperature 0) depend on the history only; sampled ones
also mix in the seed and temperature, so a seed reproduces its output (no seed means
seed 0: the sim stays reproducible).

A request served with a LoRA adapter starts from its adapter's history root
(`history_root`), so each adapter answers a prompt with its own tokens, deterministically.

Generated ids lie in [first_normal_token, vocab_size): the sim never emits special ids.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from shared.errors import InvalidArgument
from shared.schemas.generate import FinishReason, SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
HISTORY_ROOT = 0x6A09E667F3BCC908  # state of the empty history
DEFAULT_FIRST_NORMAL_TOKEN = 3


def _mix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def fold_token(state: int, token_id: int) -> int:
    """The history state after appending one token."""
    return _mix64(((state ^ token_id) + _GOLDEN) & _MASK64)


def fold_tokens(token_ids: Iterable[int], state: int = HISTORY_ROOT) -> int:
    """The history state after appending `token_ids` to the history `state` stands for."""
    for token_id in token_ids:
        state = _mix64(((state ^ token_id) + _GOLDEN) & _MASK64)
    return state


def history_root(adapter: str) -> int:
    """The state of the empty history of a request served with `adapter` ("": the base model,
    `HISTORY_ROOT`)."""
    return fold_tokens(adapter.encode(), _mix64(HISTORY_ROOT ^ _GOLDEN)) if adapter else HISTORY_ROOT


# What the sim's token model honours; a request setting any other sampling field is refused.
MODELLED_FIELDS = frozenset({"max_tokens", "temperature", "seed", "stop_token_ids", "ignore_eos", "replayed"})


def refuse_unmodelled(sampling: SamplingParams) -> None:
    """Raise InvalidArgument naming the sampling fields the sim's token model cannot honour."""
    unmodelled = [name for name in sampling.non_default_fields() if name not in MODELLED_FIELDS]
    if unmodelled:
        raise InvalidArgument(f"the sim engine does not model {', '.join(unmodelled)}: its tokens are a function "
                              f"of the history; serve such requests with the vllm engine")


def next_token(state: int, sampling: SamplingParams, vocab_size: int,
               first_normal_token: int = DEFAULT_FIRST_NORMAL_TOKEN) -> int:
    """The token a request with history `state` generates next."""
    assert vocab_size > first_normal_token >= 0, "the vocabulary has no normal tokens"
    pick = state
    if sampling.temperature > 0:
        seed = sampling.seed or 0
        (temperature_bits,) = struct.unpack("<Q", struct.pack("<d", sampling.temperature))
        pick = _mix64(pick ^ _mix64((seed & _MASK64) ^ _GOLDEN)) ^ temperature_bits
        pick = _mix64(pick)
    return first_normal_token + _mix64(pick ^ _GOLDEN) % (vocab_size - first_normal_token)


def finish_reason(token_id: int, completion_tokens: int, sampling: SamplingParams) -> FinishReason | None:
    """Why a request stops after generating `token_id` as its `completion_tokens`-th token."""
    if token_id in sampling.stop_token_ids:
        return "stop"
    if completion_tokens >= sampling.max_tokens:
        return "length"
    return None


def generate_tokens(token_ids: list[int], sampling: SamplingParams, vocab_size: int,
                    first_normal_token: int = DEFAULT_FIRST_NORMAL_TOKEN) -> tuple[list[int], FinishReason]:
    """The whole completion for a prompt, as the sim engine produces it (reference for tests)."""
    state = fold_tokens(token_ids)
    output: list[int] = []
    while True:
        token_id = next_token(state, sampling, vocab_size, first_normal_token)
        output.append(token_id)
        state = fold_token(state, token_id)
        reason = finish_reason(token_id, len(output), sampling)
        if reason is not None:
            return output, reason
