"""A model directory's config as its text model's fields (`shared.model_config`), nested under
`text_config` (a vision-language model's) or flat (a text model's); and a chat template that
loops over content parts (`shared.chat_content`) renders a chat as vLLM's server does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.worker.vllm.spec import kv_cache_settings
from shared.chat_content import content_format
from shared.lora_adapter import projection_shape
from shared.model_config import read_text_config, text_config
from shared.tiny_model import EOS_ID, llama_config
from shared.tokenizer import FIXED_CHAT_TEMPLATE, Tokenizer
from shared.vision_model import CHAT_TEMPLATE, IDEFICS3_TOKENS, generate_vision_model

LLAMA = llama_config(vocab_size=2048, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=128, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "vision"
    generate_vision_model(str(path), max_position_embeddings=1024)
    return path


def test_a_flat_config_is_its_own_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_text_config(tmp_path) == LLAMA


def test_a_nested_text_config_wins_over_the_top_level() -> None:
    config = {"model_type": "idefics3", "image_token_id": 7, "vocab_size": 9, "text_config": LLAMA,
              "vision_config": {"hidden_size": 32}}
    text = text_config(config)
    assert {key: text[key] for key in LLAMA} == LLAMA  # vocab_size, model_type: the text model's
    assert text["image_token_id"] == 7 and "text_config" not in text


def test_the_vision_model_reads_as_its_text_model(vision_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(vision_dir))
    assert (tokenizer.max_model_len, tokenizer.vocab_size, tokenizer.eos_token_id) == (1024, 2048, EOS_ID)
    text = read_text_config(vision_dir)
    assert projection_shape(text, "k_proj") == (text["num_key_value_heads"] * text["head_dim"], text["hidden_size"])
    flat = vision_dir.parent / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps(text))
    assert kv_cache_settings(40, 128, str(vision_dir)) == kv_cache_settings(40, 128, str(flat))


def test_a_template_looping_over_content_parts_takes_the_openai_format() -> None:
    assert content_format(CHAT_TEMPLATE) == "openai"
    assert content_format(FIXED_CHAT_TEMPLATE) == "string"
    assert content_format(None) == "string"
    assert content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    # a loop over a slice of messages, over the content through a filter, or inside a macro
    assert content_format("{% set turns = messages[1:] %}{% for m in turns %}{% for p in m.content | list %}"
                          "{{ p.text }}{% endfor %}{% endfor %}") == "openai"
    assert content_format("{% macro show(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
                          "{% for m in messages %}{{ show(m['content']) }}{% endfor %}") == "openai"
    assert content_format("{% for m in messages %}{{ m['content'] }}") == "string"  # does not parse


def test_the_vision_model_renders_a_text_chat_as_vllm_does(vision_dir: Path) -> None:
    """A string content is one text part for Idefics3's template (its role, then `: `)."""
    tokenizer = Tokenizer.from_model_dir(str(vision_dir))
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hello there"}])
    assert prompt == ("<|begin_of_text|>System: Be brief.<end_of_utterance>\n"
                      "User: Hello there<end_of_utterance>\nAssistant:")
    begin = tokenizer.encode(IDEFICS3_TOKENS[0])  # <|begin_of_text|>: written by the template, added by none
    ids = tokenizer.encode(prompt)
    assert len(begin) == 1 and ids[0] == begin[0] and ids.count(begin[0]) == 1


def test_text_parts_reach_each_template_as_vllm_hands_them_over(vision_dir: Path, tmp_path: Path) -> None:
    """Two text parts: joined by a newline for a template that takes a string (the tiny
    model's; vLLM's `_parse_chat_message_content_parts`), kept apart for one that loops over
    parts (Idefics3's concatenates them); a tool's parts joined for either."""
    from services.router.openai.protocol_messages import ChatMessage
    from shared.chat_content import as_content_parts, as_text
    from shared.tiny_model import generate_tiny_model

    parts = ChatMessage(role="user", content=[{"type": "text", "text": "Once upon"},
                                              {"type": "text", "text": "a time"}]).template_message()
    assert parts["content"] == [{"type": "text", "text": "Once upon"}, {"type": "text", "text": "a time"}]
    generate_tiny_model(str(tmp_path / "tiny"))
    tiny = Tokenizer.from_model_dir(str(tmp_path / "tiny"))
    assert tiny.apply_chat_template([parts]) == tiny.apply_chat_template([{"role": "user",
                                                                          "content": "Once upon\na time"}])
    vision = Tokenizer.from_model_dir(str(vision_dir))
    assert "User: Once upona time<end_of_utterance>" in vision.apply_chat_template([parts])
    tool = {"role": "tool", "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]}
    assert as_content_parts([tool])[0]["content"] == as_text([tool])[0]["content"] == "1\n2"
