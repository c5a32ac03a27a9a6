"""Tandem's sampling parameters as vLLM's, and vLLM's log-probabilities as Tandem's."""

from __future__ import annotations

import json
from typing import Any

from vllm.config import StructuredOutputsConfig
from vllm.logprobs import Logprob
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.sampling_params import SamplingParams as VllmSamplingParams

from connector.vllm.kv_wire import TransferOrder, order_params
from services.worker.vllm.replay import REPLAY_PROCESSOR, REPLAYED_ARG
from shared.schemas.generate import SamplingParams, StructuredOutput, TokenLogprobs

# The engine's own logits processors, by name (vLLM loads them in its engine process).
LOGITS_PROCESSORS = [REPLAY_PROCESSOR]


def vllm_sampling_params(sampling: SamplingParams, order: TransferOrder | None = None) -> VllmSamplingParams:
    extra: dict[str, Any] = {"kv_transfer_params": order_params(order)} if order is not None else {}
    if sampling.replayed:
        extra[REPLAYED_ARG] = list(sampling.replayed)
    return VllmSamplingParams(
        max_tokens=sampling.max_tokens, temperature=sampling.temperature, seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
        top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty, min_tokens=sampling.min_tokens,
        logit_bias=dict(sampling.logit_bias) or None, bad_words=list(sampling.bad_words) or None,
        allowed_token_ids=sampling.allowed_token_ids, logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs, structured_outputs=_structured(sampling.structured),
        output_kind=RequestOutputKind.DELTA, detokenize=False, extra_args=extra or None)


def token_logprobs(positions: list[dict[int, Logprob]] | None, new_tokens: int) -> list[TokenLogprobs] | None:
    """vLLM's log-probabilities of the output's new tokens (a delta output carries theirs only)."""
    if positions is None:
        return None
    assert len(positions) == new_tokens, (len(positions), new_tokens)
    return [_position(position) for position in positions]


def prompt_token_logprobs(positions: list[dict[int, Logprob] | None] | None) -> list[TokenLogprobs | None] | None:
    """vLLM's prompt log-probabilities (the first position has none)."""
    if positions is None:
        return None
    return [None if position is None else _position(position) for position in positions]


def _position(position: dict[int, Logprob]) -> TokenLogprobs:
    return TokenLogprobs(token_ids=list(position), logprobs=[entry.logprob for entry in position.values()],
                         ranks=[entry.rank if entry.rank is not None else 0 for entry in position.values()])


def _structured(structured: StructuredOutput | None) -> StructuredOutputsParams | None:
    if structured is None:
        return None
    return StructuredOutputsParams(
        json=json.loads(structured.json_schema) if structured.json_schema is not None else None,
        json_object=True if structured.json_object else None, regex=structured.regex, choice=structured.choice,
        grammar=structured.grammar)


def structured_outputs_config(json_any_whitespace: bool) -> StructuredOutputsConfig:
    """vLLM's choice of backend, unless JSON must leave whitespace out: only some backends can,
    and vLLM asks for one by name then (xgrammar, its first choice)."""
    if json_any_whitespace:
        return StructuredOutputsConfig()
    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
