"""A model directory's `config.json` as the text model's fields: the one reader of it.

A vision-language model's config (Idefics3, LLaVA, Qwen2-VL, ...) nests its language
model's fields (`max_position_embeddings`, `vocab_size`, `eos_token_id`, the layer and head
counts) under `text_config`, beside the vision tower's; a text model's config holds them at
the top. `text_config` answers the text model's fields either way, so the tokenizer
(`shared.tokenizer.Tokenizer.from_model_dir`), the LoRA adapter generator
(`shared.lora_adapter`) and the vLLM worker's KV cache sizing
(`services.worker.vllm.spec.kv_cache_settings`) read one shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_text_config(model_dir: str | Path) -> dict[str, Any]:
    """The text model's fields of `model_dir`'s `config.json`."""
    path = Path(model_dir) / "config.json"
    with path.open(encoding="utf-8") as handle:
        config = json.load(handle)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return text_config(config)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: a nested `text_config` over the top level's (where a field is
    only at the top, e.g. a multimodal config's own `eos_token_id`, the top level's)."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    return {**{key: value for key, value in config.items() if key != "text_config"}, **nested}
