"""Each engine sizes its own KV cache from a block count (`EngineSpec.kv_cache_settings`):
what a benchmark passes so every engine's cache holds the same blocks of the model."""

from __future__ import annotations

import json
from pathlib import Path

from launch.service_commands import WORKER_COMMAND
from services.worker.engines import engine_spec


def test_the_sim_takes_a_block_count(tmp_path: Path) -> None:
    assert engine_spec("sim").kv_cache_settings(48, 16, str(tmp_path)) == {"kv_blocks": 48, "block_size": 16}


def test_vllm_takes_the_bytes_of_that_many_blocks_of_the_models_16_bit_kv(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}))
    settings = engine_spec("vllm").kv_cache_settings(40, 128, str(tmp_path))
    per_block = 2 * 3 * 2 * (512 // 8) * 128 * 2  # K and V, layers, KV heads, head size, tokens, 2 bytes
    assert settings == {"vllm_kv_cache_gib": 40 * per_block / (1 << 30), "vllm_block_size": 128}
    # the settings are worker flags: the worker command takes them as they are
    argv = WORKER_COMMAND.setting_flags(settings)
    assert argv == ["--vllm-kv-cache-gib", str(settings["vllm_kv_cache_gib"]), "--vllm-block-size", "128"]
