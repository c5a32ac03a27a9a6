"""Tandem's table of request fields (`services.router.openai.request_fields`) against vLLM's own
OpenAI request models (the pinned vLLM's pydantic classes, imported; no engine runs).

- Every field vLLM's server defines for an endpoint has a row: served (honoured, or of no
  effect as on vLLM's server), or refused with the reason Tandem refuses it; a field a new vLLM
  adds fails here, named, before any client can send it and be told it does not exist.
- Every row that says vLLM's server defines the field (`origin` "vllm") is one of its fields,
  and a field Tandem takes that vLLM's server does not define is listed as OpenAI's (checked
  against the openai client in tests/unit/test_sampling_fields.py) or Tandem's own.
- The stream options are vLLM's (a nested model: `continuous_usage_stats` was missed there).
"""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from services.router.openai.protocol import StreamOptions
from services.router.openai.request_fields import fields_of

protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol",
                               reason="vLLM is not installed in this venv (make install-vllm)")
chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")

VLLM_REQUESTS = [(protocol.CompletionRequest, "completions"), (chat_protocol.ChatCompletionRequest, "chat")]
ENDPOINT_IDS = ["completions", "chat"]


@pytest.mark.parametrize(("vllm_request", "endpoint"), VLLM_REQUESTS, ids=ENDPOINT_IDS)
def test_every_field_of_vllms_request_is_served_or_refused_with_its_reason(vllm_request, endpoint) -> None:
    ours = fields_of(endpoint)
    missing = sorted(set(vllm_request.model_fields) - set(ours))
    assert not missing, (f"vLLM's {vllm_request.__name__} defines fields Tandem's table (request_fields) lacks: "
                         f"{missing}; serve each, or list it as refused with the reason")
    unexplained = sorted(name for name in vllm_request.model_fields
                         if ours[name].status == "refused unless default" and not ours[name].note)
    assert not unexplained, f"refused without a reason: {unexplained}"


@pytest.mark.parametrize(("vllm_request", "endpoint"), VLLM_REQUESTS, ids=ENDPOINT_IDS)
def test_a_field_vllm_does_not_define_is_listed_as_openais_or_tandems(vllm_request, endpoint) -> None:
    vllms = set(vllm_request.model_fields)
    ours = fields_of(endpoint)
    not_vllms = sorted(name for name, field in ours.items() if field.origin == "vllm" and name not in vllms)
    assert not not_vllms, (f"rows saying vLLM's server defines them, which its {vllm_request.__name__} does not: "
                           f"{not_vllms}; give each its origin (OpenAI's or Tandem's)")
    now_vllms = sorted(name for name, field in ours.items() if field.origin != "vllm" and name in vllms)
    assert not now_vllms, f"vLLM's {vllm_request.__name__} defines these now: {now_vllms}; their origin is vLLM's"


def _model_of(annotation: object) -> type[BaseModel]:
    """The one pydantic model in `annotation` (`Model | None`)."""
    models = [arg for arg in typing.get_args(annotation) or (annotation,)
              if isinstance(arg, type) and issubclass(arg, BaseModel)]
    assert len(models) == 1, annotation
    return models[0]


@pytest.mark.parametrize(("vllm_request", "endpoint"), VLLM_REQUESTS, ids=ENDPOINT_IDS)
def test_tandems_stream_options_are_vllms(vllm_request, endpoint) -> None:
    vllms = set(_model_of(vllm_request.model_fields["stream_options"].annotation).model_fields)
    assert vllms == set(StreamOptions.model_fields), f"vLLM's stream options: {sorted(vllms)}"
