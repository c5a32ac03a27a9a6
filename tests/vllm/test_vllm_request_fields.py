"""Every field of vLLM's own OpenAI request models (the pinned vLLM) has a status in Tandem's
table (`services.router.openai.request_fields`): none can be sent to Tandem and silently ignored."""

from __future__ import annotations

import pytest

from services.router.openai.request_fields import fields_of

protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")


@pytest.mark.parametrize(("vllm_model", "endpoint"), [(protocol.CompletionRequest, "completions"),
                                                       (chat_protocol.ChatCompletionRequest, "chat")])
def test_every_field_of_vllms_request_has_a_status_in_tandems_table(vllm_model, endpoint) -> None:
    ours = fields_of(endpoint)
    missing = sorted(set(vllm_model.model_fields) - set(ours))
    assert not missing, f"vLLM's {vllm_model.__name__} fields without a status in request_fields: {missing}"
