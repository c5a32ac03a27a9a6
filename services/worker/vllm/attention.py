"""Which attention kernel vLLM runs, said once at start-up so a host's path is visible.

On CPU, vLLM's attention backend picks an instruction set per model and host
(`vllm.v1.attention.backends.cpu_attn._get_attn_isa`): "amx" for bfloat16 with block
sizes divisible by 32 where the CPU has AMX tiles, else AVX-512 / vectorised fallbacks.
The AMX kernel needs the process's AMX tile state, which `connector.vllm.amx` asks for
in every vLLM process. On a GPU the backend is vLLM's per-device choice.
"""

from __future__ import annotations

from vllm.config import VllmConfig


def attention_isa(config: VllmConfig) -> str:
    """The CPU attention kernel's instruction set ("amx", "vec", "vec16", ...), or the
    device type on other devices; "unknown" where this vLLM does not say."""
    device = config.device_config.device_type
    if device != "cpu":
        return str(device)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = config.model_config, config.cache_config
        return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    except (ImportError, TypeError, NotImplementedError):
        return "unknown"
