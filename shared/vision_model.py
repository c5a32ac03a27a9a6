"""A tiny random-weight Idefics3 generated locally: the project's vision-language model.

`tandem model vision DIR` (cli/model.py) writes it; tests/vllm/test_vllm_vision_model.py serves
it on vLLM's CPU build with image inputs.

Idefics3 (SigLIP-style vision tower, pixel-shuffle connector, Llama text model) is the
family because vLLM's CPU build serves it as installed: Qwen2-VL, LLaVA and most other
families import transformers' torchvision image processors, and the CPU venv has no
torchvision (its CUDA build breaks vLLM's import), while Idefics3's processor falls back to
Pillow. The text model is `shared.tiny_model`'s Llama (its shapes, config and tokenizer).

The directory holds an Idefics3 `config.json` with tiny dimensions, random weights under
the checkpoint names vLLM's loader takes, the tiny BPE tokenizer plus Idefics3's special
tokens, Idefics3-8B-Llama3's chat template (an image part renders as `<image>`), and its
processor's `preprocessor_config.json` / `processor_config.json`. The processor replaces
each `<image>` by tiles of 56x56 pixels (at most 2x2 of them, plus the whole image scaled
down), each `IMAGE_SEQ_LEN` image tokens between marker tokens. As `shared.tiny_model`,
the output is a pure function of the arguments (same arguments, byte-identical files).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer

from shared.tiny_model import (
    _json,
    _write_atomic,
    is_complete_model_dir,
    llama_config,
    llama_weight_shapes,
    random_weights,
    train_tokenizer,
)

ARCHITECTURE = "Idefics3ForConditionalGeneration"
IMAGE_SIZE = 56  # one tile's side in pixels
PATCH_SIZE = 14
SCALE_FACTOR = 2  # the connector's pixel shuffle: 2x2 patches become one token
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2  # image tokens per tile: 4
MAX_TILES_PER_SIDE = 2
# Idefics3's special tokens, appended after the trained vocabulary in this order; the
# processor looks up the row and column tags of a grid of up to 6x6 tiles.
IDEFICS3_TOKENS = ("<|begin_of_text|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
                   "<global-img>", *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)))

# HuggingFaceM4/Idefics3-8B-Llama3's chat template, verbatim.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'].capitalize()}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
               "processor_config.json", "generation_config.json", "config.json")


def generate_vision_model(
    out_dir: str,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    vision_layers: int = 2,
    vision_width: int = 64,
    vision_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> None:
    """Write an Idefics3 model directory to `out_dir`; leave an already complete one alone.

    `vocab_size` counts Idefics3's special tokens (the last 41 ids). `head_dim` is explicit
    for the reason `shared.tiny_model.generate_tiny_model` gives.
    """
    path = Path(out_dir)
    if is_complete_model_dir(path):
        return
    if num_heads % num_kv_heads or vision_width % vision_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads, vision_width of vision_heads")
    tokenizer = vision_tokenizer(vocab_size)
    path.mkdir(parents=True, exist_ok=True)

    text = llama_weight_shapes(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               intermediate_size=intermediate_size)
    shapes = {name.replace("model.", "model.text_model.", 1): shape for name, shape in text.items()}
    shapes |= vision_weight_shapes(layers=vision_layers, width=vision_width, out_size=hidden_size)
    _write_weights(path, shapes, seed)

    text_config = llama_config(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
    del text_config["architectures"]
    token_ids = {token: tokenizer.token_to_id(token) for token in IDEFICS3_TOKENS}
    config = model_config(text_config, token_ids["<image>"], vision_layers=vision_layers, vision_width=vision_width,
                          vision_heads=vision_heads)
    _write_atomic(path / "tokenizer.json", tokenizer.to_str())
    _write_atomic(path / "tokenizer_config.json", _json(tokenizer_config(max_position_embeddings)))
    _write_processor_files(path, bos_id=token_ids["<|begin_of_text|>"],
                           eos_ids=[token_ids["<end_of_utterance>"], text_config["eos_token_id"]])
    _write_atomic(path / "config.json", _json(config))  # last: its presence marks a finished directory


def _write_processor_files(path: Path, *, bos_id: int, eos_ids: list[int]) -> None:
    """The image processor's, the processor's and generation's config files."""
    _write_atomic(path / "preprocessor_config.json", _json(preprocessor_config()))
    _write_atomic(path / "processor_config.json", _json({"image_seq_len": IMAGE_SEQ_LEN,
                                                         "processor_class": "Idefics3Processor"}))
    _write_atomic(path / "generation_config.json", _json({"bos_token_id": bos_id, "eos_token_id": eos_ids}))


def vision_tokenizer(vocab_size: int) -> Tokenizer:
    """tiny_model's BPE tokenizer with Idefics3's special tokens as its last ids."""
    tokenizer = train_tokenizer(vocab_size - len(IDEFICS3_TOKENS))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in IDEFICS3_TOKENS])
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def _write_weights(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """Random weights of `shapes` as `model.safetensors`, written atomically."""
    with tempfile.NamedTemporaryFile(dir=path, prefix=".model.", suffix=".tmp", delete=False) as tmp:
        tmp_name = tmp.name
    save_file(_in_shape(random_weights(_as_matrices(shapes), seed), shapes), tmp_name, metadata={"format": "pt"})
    os.replace(tmp_name, path / "model.safetensors")


def model_config(text_config: dict[str, object], image_token_id: int, *, vision_layers: int, vision_width: int,
                 vision_heads: int) -> dict[str, object]:
    """Idefics3's config.json: the text model's config nested, the vision tower's beside it."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "idefics3", "torch_dtype": "float32",
        "tie_word_embeddings": False, "scale_factor": SCALE_FACTOR, "image_token_id": image_token_id,
        "text_config": text_config,
        "vision_config": {"model_type": "idefics3_vision", "hidden_size": vision_width,
                          "intermediate_size": 2 * vision_width, "num_hidden_layers": vision_layers,
                          "num_attention_heads": vision_heads, "num_channels": 3, "image_size": IMAGE_SIZE,
                          "patch_size": PATCH_SIZE, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    }


def vision_weight_shapes(*, layers: int, width: int, out_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of Idefics3's vision tower (MLP twice as wide) and connector, by checkpoint name."""
    tower = "model.vision_model"
    shapes: dict[str, tuple[int, ...]] = {
        f"{tower}.embeddings.patch_embedding.weight": (width, 3, PATCH_SIZE, PATCH_SIZE),
        f"{tower}.embeddings.patch_embedding.bias": (width,),
        f"{tower}.embeddings.position_embedding.weight": ((IMAGE_SIZE // PATCH_SIZE) ** 2, width),
        f"{tower}.post_layernorm.weight": (width,), f"{tower}.post_layernorm.bias": (width,),
        "model.connector.modality_projection.proj.weight": (out_size, width * SCALE_FACTOR ** 2),
    }
    for layer in range(layers):
        prefix = f"{tower}.encoder.layers.{layer}"
        shapes |= {f"{prefix}.self_attn.{proj}.{part}": (width, width) if part == "weight" else (width,)
                   for proj in ("q_proj", "k_proj", "v_proj", "out_proj") for part in ("weight", "bias")}
        shapes |= {
            f"{prefix}.layer_norm1.weight": (width,), f"{prefix}.layer_norm1.bias": (width,),
            f"{prefix}.layer_norm2.weight": (width,), f"{prefix}.layer_norm2.bias": (width,),
            f"{prefix}.mlp.fc1.weight": (2 * width, width), f"{prefix}.mlp.fc1.bias": (2 * width,),
            f"{prefix}.mlp.fc2.weight": (width, 2 * width), f"{prefix}.mlp.fc2.bias": (width,),
        }
    return shapes


def _as_matrices(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    # random_weights scales a matrix by its second dimension: the patch embedding's fan-in is
    # all of a patch's values (channels x pixels), so it is drawn as a matrix and reshaped.
    return {name: (shape[0], int(np.prod(shape[1:]))) if len(shape) > 2 else shape for name, shape in shapes.items()}


def _in_shape(weights: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The drawn weights in their real shapes, biases zero (random_weights gives every vector ones)."""
    return {name: np.zeros_like(weight) if name.endswith(".bias") else weight.reshape(shapes[name])
            for name, weight in weights.items()}


def tokenizer_config(max_position_embeddings: int) -> dict[str, object]:
    """`tokenizer_config.json`: Idefics3's special tokens and chat template (which writes the BOS)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<end_of_utterance>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "processor_class": "Idefics3Processor",
    }


def preprocessor_config() -> dict[str, object]:
    """`preprocessor_config.json`: Idefics3's image processor with tiny tiles."""
    return {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True, "do_pad": True,
        "do_image_splitting": True, "resample": 1, "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "size": {"longest_edge": MAX_TILES_PER_SIDE * IMAGE_SIZE},
    }
