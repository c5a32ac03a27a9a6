"""`tandem model tiny --vocab-size`: a tiny model with another vocabulary (a second model to
serve behind one router); a vocabulary smaller than the byte alphabet is refused."""

from __future__ import annotations

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
