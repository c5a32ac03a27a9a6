"""The generated Idefics3 vision-language model: complete, reproducible, an Idefics3 by its
config, weights and tokenizer; `tandem model vision` writes it. vLLM serving it with images
is tests/vllm/test_vllm_vision_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer as BackendTokenizer
from typer.testing import CliRunner

from cli.model import app
from shared.tokenizer import compile_chat_template
from shared.vision_model import IDEFICS3_TOKENS, IMAGE_SEQ_LEN, MODEL_FILES, generate_vision_model


@pytest.fixture(scope="module")
def model_dir(vision_model_dir: str) -> Path:
    return Path(vision_model_dir)


def test_the_directory_is_a_complete_idefics3(model_dir: Path) -> None:
    assert sorted(path.name for path in model_dir.iterdir()) == sorted(MODEL_FILES)
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Idefics3ForConditionalGeneration"], "idefics3")
    vision, text = config["vision_config"], config["text_config"]
    assert (vision["image_size"] // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2 == IMAGE_SEQ_LEN
    processor = json.loads((model_dir / "processor_config.json").read_text())
    assert processor == {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "Idefics3Processor"}
    weights = load_file(model_dir / "model.safetensors")
    assert weights["model.text_model.embed_tokens.weight"].shape == (text["vocab_size"], text["hidden_size"])
    assert weights["model.vision_model.embeddings.patch_embedding.weight"].shape == (vision["hidden_size"], 3, 14, 14)
    assert weights["model.connector.modality_projection.proj.weight"].shape == (text["hidden_size"],
                                                                                 4 * vision["hidden_size"])
    assert not weights["model.vision_model.encoder.layers.1.mlp.fc1.bias"].any()
    assert sum(array.size for array in weights.values()) < 500_000  # small enough for CI


def test_the_tokenizer_knows_idefics3s_tokens_and_the_template_renders_an_image(model_dir: Path) -> None:
    tokenizer = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["text_config"]["vocab_size"]
    ids = [tokenizer.encode(token).ids for token in IDEFICS3_TOKENS]
    assert all(len(token_ids) == 1 for token_ids in ids)
    assert ids[IDEFICS3_TOKENS.index("<image>")] == [config["image_token_id"]]
    template = compile_chat_template(json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|begin_of_text|>User:<image>What is it?<end_of_utterance>\nAssistant:")


def test_the_same_seed_gives_the_same_bytes(model_dir: Path, tmp_path: Path) -> None:
    generate_vision_model(str(tmp_path / "again"))
    generate_vision_model(str(tmp_path / "other"), seed=1)
    for name in MODEL_FILES:
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_tandem_model_vision_writes_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["vision", str(tmp_path / "vision")])
    assert result.exit_code == 0, result.output
    assert all((tmp_path / "vision" / name).is_file() for name in MODEL_FILES)
