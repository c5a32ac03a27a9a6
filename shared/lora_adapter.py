"""A random-weight LoRA adapter for a generated Llama model, in PEFT's layout.

`adapter_config.json` and `adapter_model.safetensors` (A and B of each targeted projection of
each layer, `base_model.model.model.layers.<i>.self_attn.<proj>.lora_{A,B}.weight`), as vLLM
and PEFT load them. Unlike PEFT's initialisation (B = 0: the adapter changes nothing), both
matrices are random, so that each adapter answers differently from the base model and from
another seed's adapter. Used by `tandem model lora` and the tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from shared.model_config import read_text_config

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shape(config: dict, module: str) -> tuple[int, int]:
    """(out_features, in_features) of one attention projection of the base model (`config`: its
    text model's fields, `shared.model_config`)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}[module]


def generate_lora_adapter(out_dir: str, base_model_dir: str, *, rank: int = 8, alpha: int = 16, seed: int = 0,
                          target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> None:
    """Write a random LoRA adapter of `rank` on `target_modules` for the model in `base_model_dir`."""
    unknown = [module for module in target_modules if module not in _ATTENTION]
    if rank <= 0 or unknown or not target_modules:
        raise ValueError(f"rank must be positive and target modules among {', '.join(_ATTENTION)} "
                         f"(got rank {rank}, modules {', '.join(target_modules) or 'none'})")
    config = read_text_config(base_model_dir)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in target_modules:
            out_features, in_features = projection_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = rng.normal(0.0, in_features ** -0.5,
                                                            size=(rank, in_features)).astype(np.float32)
            weights[f"{prefix}.lora_B.weight"] = rng.normal(0.0, rank ** -0.5,
                                                            size=(out_features, rank)).astype(np.float32)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(target_modules), "fan_in_fan_out": False, "use_rslora": False,
        "modules_to_save": None, "base_model_name_or_path": str(Path(base_model_dir).resolve()),
    }
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(path / "adapter_model.safetensors.tmp", path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
