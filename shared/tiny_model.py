"""A tiny random-weight Llama generated locally, for tests, demos and the sim engine.

No model hub is reachable from the machines Tandem is developed on, so the project makes
its own model directory: a byte-level BPE tokenizer trained with `tokenizers` on the
packaged corpus (`shared/corpus/*.txt`), a Llama `config.json`, and random float32
weights in `model.safetensors`. vLLM loads it like any Llama; random weights give
varied but reproducible greedy text. The same generator writes the larger shapes of
`shared.model_shapes` (real models' layer counts and widths, random weights).

The output is a pure function of the arguments (same arguments, byte-identical files),
so two workers that generate the same directory agree on every token id.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.tokenizer import FIXED_CHAT_TEMPLATE

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# config.json is written last: its presence next to the others marks a finished directory.
_MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "config.json")


def corpus_texts() -> list[str]:
    """The packaged training prose, in a fixed order (file order changes the merges)."""
    corpus = resources.files("shared") / "corpus"
    names = sorted(entry.name for entry in corpus.iterdir() if entry.name.endswith(".txt"))
    return [(corpus / name).read_text(encoding="utf-8") for name in names]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids; `<unk>`=0, `<s>`=1, `</s>`=2.

    The corpus yields a few thousand merges; a larger vocabulary is padded with reserved
    tokens so the tokenizer and the embedding always agree. Unlike Llama 3's, they are not
    special: a random model's greedy output lands on them most of the time (46,000 of the
    real shapes' 49,152 ids), and each must still stream as text, or a benchmark sees
    tokens with no text and cannot time them.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + len(alphabet)}")
    tokenizer = Tokenizer(models.BPE())
    # No prefix space and no normaliser: decode(encode(text)) == text for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(corpus_texts(), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([AddedToken(f"<|reserved_{i}|>", special=False) for i in range(missing)])
    assert tokenizer.get_vocab_size() == vocab_size
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [UNK_ID, BOS_ID, EOS_ID]
    return tokenizer


def llama_weight_shapes(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                        num_kv_heads: int, head_dim: int, intermediate_size: int
                        ) -> dict[str, tuple[int, ...]]:
    """Every parameter of `LlamaForCausalLM` (untied embeddings), by its checkpoint name."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden_size),
        "model.norm.weight": (hidden_size,),
        "lm_head.weight": (vocab_size, hidden_size),
    }
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden_size,),
            f"{prefix}.post_attention_layernorm.weight": (hidden_size,),
            f"{prefix}.self_attn.q_proj.weight": (num_heads * head_dim, hidden_size),
            f"{prefix}.self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{prefix}.self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{prefix}.self_attn.o_proj.weight": (hidden_size, num_heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (intermediate_size, hidden_size),
            f"{prefix}.mlp.up_proj.weight": (intermediate_size, hidden_size),
            f"{prefix}.mlp.down_proj.weight": (hidden_size, intermediate_size),
        }
    return shapes


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name in sorted(shapes):  # a fixed draw order keeps the bytes reproducible
        shape = shapes[name]
        if len(shape) == 1:  # RMSNorm gains
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            # 1/sqrt(fan_in) keeps activations and logits near unit scale, so greedy
            # decoding depends on the context instead of repeating one token.
            weights[name] = rng.normal(0.0, shape[1] ** -0.5, size=shape).astype(np.float32)
    return weights


def generate_tiny_model(
    out_dir: str,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    head_dim: int = 32,
    seed: int = 0,
) -> None:
    """Write a Llama model directory to `out_dir`; leave an already complete one alone.

    `head_dim` is explicit (Llama configs allow it) because vLLM's CPU attention supports
    head sizes of 32 and up, while hidden_size / num_heads would be 16 here.
    """
    path = Path(out_dir)
    if is_complete_model_dir(path):
        return
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    tokenizer = train_tokenizer(vocab_size)  # refuses a vocabulary too small before any file is made
    path.mkdir(parents=True, exist_ok=True)
    shapes = llama_weight_shapes(vocab_size=vocab_size, hidden_size=hidden_size,
                                 num_layers=num_layers, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 intermediate_size=intermediate_size)
    config = llama_config(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                          num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings)
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}

    with tempfile.NamedTemporaryFile(dir=path, prefix=".model.", suffix=".tmp", delete=False) as tmp:
        tmp_name = tmp.name
    save_file(random_weights(shapes, seed), tmp_name, metadata={"format": "pt"})
    os.replace(tmp_name, path / "model.safetensors")
    _write_atomic(path / "tokenizer.json", tokenizer.to_str())
    _write_atomic(path / "tokenizer_config.json", _json(tokenizer_config(max_position_embeddings)))
    _write_atomic(path / "generation_config.json", _json(generation_config))
    _write_atomic(path / "config.json", _json(config))


def llama_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, max_position_embeddings: int) -> dict[str, object]:
    """The model's `config.json`: a float32 `LlamaForCausalLM` with untied embeddings."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def tokenizer_config(max_position_embeddings: int) -> dict[str, object]:
    """The tokenizer's `tokenizer_config.json`: no BOS or EOS added, Tandem's fixed chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": FIXED_CHAT_TEMPLATE,
    }


def is_complete_model_dir(path: Path) -> bool:
    """True for a finished tiny model, and for any model directory a user brought."""
    if all((path / name).is_file() for name in _MODEL_FILES):
        return True
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _json(value: dict[str, object]) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _write_atomic(target: Path, text: str) -> None:
    # Two processes may generate the same directory at once; each rename is atomic and
    # both write identical bytes, so a reader never sees a torn file.
    with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.",
                                     suffix=".tmp", delete=False, encoding="utf-8") as tmp:
        tmp.write(text)
    os.replace(tmp.name, target)


def model_dir_or_tiny(model_dir: str, state_dir: Path) -> str:
    """`model_dir`, or where none is named the tiny model kept under `state_dir` (generated the
    first time): what the benchmarks run on by default."""
    return model_dir or ensure_tiny_model(str(state_dir / "models" / "tiny"))


def ensure_tiny_model(path: str) -> str:
    """The tiny model at `path`, generated there unless it is already (benchmarks reuse it)."""
    if not (Path(path) / "config.json").exists():
        generate_tiny_model(path)
    return path
