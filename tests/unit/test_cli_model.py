"""`tandem model tiny --vocab-size`: a tiny model with another vocabulary (a second model to
serve behind one router); a vocabulary smaller than the byte alphabet is refused. `tandem model
lora`: a random LoRA adapter (PEFT layout) for a generated model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.model import app
from shared.tokenizer import Tokenizer


def test_a_tiny_model_with_another_vocabulary(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["tiny", str(tmp_path / "small"), "--vocab-size", "1024"])
    assert result.exit_code == 0, result.output
    assert Tokenizer.from_model_dir(str(tmp_path / "small")).vocab_size == 1024


def test_a_vocabulary_smaller_than_the_byte_alphabet_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["tiny", str(tmp_path / "none"), "--vocab-size", "10"])
    assert result.exit_code == 2 and "vocab_size must be at least" in result.output
    assert not (tmp_path / "none").exists()


def test_a_lora_adapter_for_a_generated_model(tmp_path: Path, tiny_model_dir: str) -> None:
    result = CliRunner().invoke(app, ["lora", str(tmp_path / "adapters" / "alpha"), "--base", tiny_model_dir,
                                      "--rank", "4", "--target", "q_proj", "--target", "o_proj", "--seed", "3"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "adapters" / "alpha" / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"]) == (4, ["q_proj", "o_proj"])
    assert (tmp_path / "adapters" / "alpha" / "adapter_model.safetensors").is_file()


def test_a_lora_adapter_needs_a_model_directory_and_known_projections(tmp_path: Path, tiny_model_dir: str) -> None:
    wide = {"COLUMNS": "300"}  # the error box does not wrap the message
    no_model = CliRunner().invoke(app, ["lora", str(tmp_path / "a"), "--base", str(tmp_path)], env=wide)
    assert no_model.exit_code == 2 and "not a model directory" in no_model.output
    unknown = CliRunner().invoke(app, ["lora", str(tmp_path / "b"), "--base", tiny_model_dir, "--target", "gate"],
                                 env=wide)
    assert unknown.exit_code == 2 and "target modules" in unknown.output
