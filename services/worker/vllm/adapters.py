"""LoRA adapters on a vLLM engine: a request's adapter name -> vLLM's `LoRARequest`.

An adapter is a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) named
after it under the worker's `--adapter-dir` (`tandem model lora` writes one). vLLM reads its
weights at the first request naming it and keeps it among its `max_loras` resident ones;
the integer id vLLM keys it by is given once per name, for the engine's life.
"""

from __future__ import annotations

from itertools import count
from pathlib import Path

from vllm.lora.request import LoRARequest

from shared.errors import InvalidArgument


class LoraCatalog:
    def __init__(self, adapter_dir: str, max_loras: int) -> None:
        self.adapter_dir = adapter_dir
        self.max_loras = max_loras
        self._ids: dict[str, int] = {}
        self._next_id = count(1)  # vLLM reserves 0 for "no adapter"

    def request(self, adapter: str) -> LoRARequest:
        """The `LoRARequest` of `adapter`; InvalidArgument when this engine cannot serve it."""
        if not self.max_loras:
            raise InvalidArgument(f"this vLLM worker serves no LoRA adapters (asked for {adapter!r}; "
                                  f"start it with --max-adapters)")
        path = Path(self.adapter_dir) / adapter
        if "/" in adapter or adapter in (".", "..") or not (path / "adapter_config.json").is_file():
            raise InvalidArgument(f"no LoRA adapter {adapter!r} in {self.adapter_dir or 'the adapter directory'} "
                                  f"(expected {path}/adapter_config.json)")
        if adapter not in self._ids:
            self._ids[adapter] = next(self._next_id)
        return LoRARequest(lora_name=adapter, lora_int_id=self._ids[adapter], lora_path=str(path.resolve()))
