"""Named Llama shapes for random-weight models (`tandem model random DIR --shape NAME`).

The tiny shape keeps tests fast; the others have the layer counts, widths and vocabularies
of real small models, so that on CPU a prompt block costs far more to compute than to move
over the KV connector, as on real serving hosts:

- `llama-135m`: SmolLM-135M's Llama shape (30 layers, hidden 576, 9 heads of 64, 3 KV
  heads, MLP 1536, vocabulary 49152): 135M parameters (162M here: untied head).
- `llama-0.5b`: a Llama of about half a billion parameters (24 layers, hidden 1024,
  16 heads of 64, 8 KV heads, MLP 4096, vocabulary 49152).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048

    def parameters(self) -> int:
        """Parameters of `LlamaForCausalLM` of this shape with untied embeddings."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def as_arguments(self) -> dict[str, int]:
        return asdict(self)


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=2048, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=128),
    "llama-135m": ModelShape(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                             head_dim=64, intermediate_size=1536),
    "llama-0.5b": ModelShape(vocab_size=49152, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8,
                             head_dim=64, intermediate_size=4096),
}


def shape_named(name: str) -> ModelShape:
    """The shape called `name`; raises `ValueError` naming the known ones."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None
