"""The vLLM engine's own options (`tandem worker --engine vllm`): its KV cache, CPU binding,
block size, compilation, structured output's whitespace, LoRA rank and encoder cache. Named
by vLLM's `EngineSpec` (`spec.VLLM`), they are the `vllm` part of the worker command's config
(`services.worker.config.WorkerCommandConfig`); its flags keep the `--vllm-` prefix. Importing
this module imports no vLLM."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.config import require
from shared.config_fields import flag

DTYPES = ("auto", "bfloat16", "float16", "float32")


class VllmEngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    max_lora_rank: Annotated[int, flag("vLLM: the largest LoRA rank an adapter may have.",
                                       name="--vllm-max-lora-rank")] = 16
    kv_cache_gib: Annotated[float, flag("vLLM: KV cache size in GiB (host memory on CPU).",
                                        name="--vllm-kv-cache-gib")] = 1.0
    cpu_threads_bind: Annotated[str, flag("vLLM on CPU: 'auto', 'nobind' or core ids like '0-3'; pin engines "
                                          "to different cores.", name="--vllm-cpu-threads-bind")] = "auto"
    block_size: Annotated[int, flag("vLLM: KV block size in tokens; 0: the platform's.", name="--vllm-block-size",
                                    doc="128 on CPU.")] = 0
    enforce_eager: Annotated[bool, flag("vLLM: eager mode (no CUDA graph capture).", name="--vllm-eager")] = True
    dtype: Annotated[str, flag("vLLM: the model's dtype: auto (the model's own; vLLM on CPU runs float32 as "
                               "bfloat16), bfloat16, float16 or float32. Part of the KV layout: workers of another "
                               "dtype never exchange KV.", name="--vllm-dtype")] = "auto"
    # structured JSON output may hold whitespace between its tokens (vLLM's default); an
    # engine setting in vLLM, not a request's
    json_any_whitespace: Annotated[bool, flag("vLLM: structured JSON output may hold whitespace between tokens.",
                                              name="--vllm-json-whitespace")] = True
    encoder_cache_dir: Annotated[str, flag(
        "vLLM: a directory the model's workers share, where the vision encoder's output for an image is kept: an "
        "image sent again (to this worker or another) is loaded, not encoded again. Empty: each worker encodes.",
        name="--vllm-encoder-cache-dir")] = ""
    encoder_cache_gib: Annotated[float, flag("vLLM: size of the encoder cache directory in GiB; the least "
                                             "recently used images go past it.", name="--vllm-encoder-cache-gib")] = 4.0

    def validate(self) -> None:
        require(self.encoder_cache_gib > 0, "the vLLM encoder cache size must be positive")
        require(self.block_size >= 0, "the vLLM block size must be positive (or 0: the platform's)")
        require(self.dtype in DTYPES, f"the vLLM dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
