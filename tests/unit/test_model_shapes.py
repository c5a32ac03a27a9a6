"""The named model shapes (shared/model_shapes.py): their parameter counts are those of the
weights `generate_tiny_model` writes, and an unknown name is refused with the known ones."""

from __future__ import annotations

import math

import pytest

from shared.model_shapes import SHAPES, shape_named
from shared.tiny_model import llama_weight_shapes


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shapes_parameter_count_is_its_checkpoints(name: str) -> None:
    shape = SHAPES[name]
    arguments = {key: value for key, value in shape.as_arguments().items() if key != "max_position_embeddings"}
    weights = llama_weight_shapes(**arguments)
    assert shape.parameters() == sum(math.prod(dims) for dims in weights.values())


def test_the_real_shapes_are_the_sizes_they_are_named_after() -> None:
    assert 160e6 < SHAPES["llama-135m"].parameters() < 165e6  # 135M with the head tied to the embedding
    assert SHAPES["llama-135m"].parameters() - 49152 * 576 == pytest.approx(134.5e6, rel=0.01)
    assert 0.45e9 < SHAPES["llama-0.5b"].parameters() < 0.5e9
    # vLLM's CPU attention wants head sizes of 32 and up
    assert all(shape.head_dim >= 32 and shape.num_heads % shape.num_kv_heads == 0 for shape in SHAPES.values())


def test_an_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model shape 'llama-70b'; known: tiny, llama-135m, llama-0.5b"):
        shape_named("llama-70b")
