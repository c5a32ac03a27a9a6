"""The generated tiny Llama: complete, reproducible, and its tokenizer round-trips text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from shared.tiny_model import EOS_ID, generate_tiny_model, llama_weight_shapes
from shared.tokenizer import FIXED_CHAT_TEMPLATE, Tokenizer, compile_chat_template, render_chat

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    generate_tiny_model(str(path))
    return path


def test_files_present_and_weights_cover_llama(model_dir: Path) -> None:
    assert all((model_dir / name).is_file() for name in FILES)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = llama_weight_shapes(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"])
    weights = load_file(model_dir / "model.safetensors")
    assert {name: array.shape for name, array in weights.items()} == expected
    assert "model.layers.1.mlp.down_proj.weight" in weights


def test_generation_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    generate_tiny_model(str(again))
    for name in FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    other_seed = tmp_path / "other-seed"
    generate_tiny_model(str(other_seed), seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (other_seed / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_complete_directory_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "m"
    generate_tiny_model(str(path))
    config = path / "config.json"
    config.write_text(config.read_text().replace('"float32"', '"float32" '))
    generate_tiny_model(str(path), seed=7)
    assert '"float32" ' in config.read_text()


def test_vocab_size_matches_config(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    assert tokenizer.vocab_size == config["vocab_size"] == 2048
    assert tokenizer._backend.get_vocab_size() == 2048
    # Beyond what the corpus yields, the vocabulary is padded with reserved tokens.
    generate_tiny_model(str(tmp_path / "big"), vocab_size=4000)
    big = Tokenizer.from_model_dir(str(tmp_path / "big"))
    assert big.vocab_size == big._backend.get_vocab_size() == 4000
    # They are not special: a random model's output lands on them, and it must stream text.
    last = big.decode([3999], skip_special_tokens=True)
    assert last.startswith("<|reserved_") and last.endswith("|>")
    assert big.encode(last + last) == [3999, 3999]
    assert big.decode([EOS_ID], skip_special_tokens=True) == ""


def test_tokenizer_round_trips_text(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(model_dir))
    for text in ("The river bends around the old mill.",
                 "  leading spaces, tabs\tand\nnewlines  ",
                 "Unicode survives: café, naïve, 水, 🙂",
                 ""):
        ids = tokenizer.encode(text)
        assert all(0 <= token < tokenizer.vocab_size for token in ids)
        assert tokenizer.decode(ids) == text
    # Trained on the corpus, common words are single tokens.
    assert len(tokenizer.encode(" river")) == 1


def test_tokenizer_metadata(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(model_dir))
    assert tokenizer.model_name == "tiny-llama"
    assert tokenizer.max_model_len == 2048
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1
    assert tokenizer.encode("hi")[:1] != [1]  # add_bos_token is false for the tiny model
    assert tokenizer.decode([72, 2]) == tokenizer.decode([72])  # specials are skipped


def test_chat_template(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(model_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert render_chat(messages, add_generation_prompt=False) == "<|system|>\nBe brief.\n<|user|>\nHi\n"
    stored = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert stored["chat_template"] == FIXED_CHAT_TEMPLATE


def test_the_template_renders_plain_chats_as_render_chat_and_tools_hermes_style(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_model_dir(str(model_dir))
    template = compile_chat_template(FIXED_CHAT_TEMPLATE)
    plain = [{"role": "system", "content": "Be <b>rief</b> & kind."}, {"role": "user", "content": "Hi\n{x}"}]
    for prompt in (True, False):  # the fast path says what the template says
        assert template.render(messages=plain, tools=None, add_generation_prompt=prompt) == \
            render_chat(plain, add_generation_prompt=prompt)
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": {"a": "<é>"}}}
    chat = [*plain, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "1"}]
    text = tokenizer.apply_chat_template(chat, tools=[tool])
    assert text.startswith("<|system|>\n# Tools\n") and '{"name": "f", "description": null, "parameters": {"a": "<é>"}}' in text
    assert '<|assistant|>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<|tool|>\n' in text
    assert text.endswith("<tool_response>ok</tool_response>\n<|assistant|>\n")


def test_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_dir(str(tmp_path / "nowhere"))
