"""Tandem's encoder-cache connector inside vLLM: the vision encoder's output for an image is
kept in a store that the workers of one model share (`connector.encoder_store`), so an
image sent again (a later turn whose prefix is not cached, another worker) is loaded, not
encoded again.

vLLM's encoder-cache contract (`ECConnectorBase`) has two halves in one class, as its KV
connector has: in the scheduler, `has_cache_item` decides that an image needs no encoding
and `update_state_after_alloc` / `build_connector_meta` name the entries the model runner
loads; in the model runner, `start_load_caches` loads them into vLLM's encoder cache and
`save_caches` stores what the encoder just computed. Started by `VllmEngine` when the
worker has `--vllm-encoder-cache-dir` (`transfer_config`, built in
`services/worker/vllm/engine_config.py`); the store's keys are the images' identifiers,
the content hashes the router sends (`shared.block_hash.image_key`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import safetensors.torch
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from connector.encoder_store import EncoderStore
from connector.vllm.settings import EncoderCacheSettings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "TandemEncoderCache"
CONNECTOR_MODULE = __name__
TENSOR = "encoder_output"


def transfer_config(settings: EncoderCacheSettings) -> ECTransferConfig:
    """vLLM's config starting this connector; every worker both stores and loads."""
    return ECTransferConfig(ec_connector=CONNECTOR_CLASS, ec_connector_module_path=CONNECTOR_MODULE,
                            ec_role="ec_both", ec_connector_extra_config=msgspec.to_builtins(settings))


@dataclass
class LoadOrder(ECConnectorMetadata):
    """The scheduler's word to the model runner for one step: the entries to load."""

    keys: list[str] = field(default_factory=list)


class TandemEncoderCache(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        assert vllm_config.ec_transfer_config is not None
        settings = msgspec.convert(vllm_config.ec_transfer_config.ec_connector_extra_config, EncoderCacheSettings)
        self._store = EncoderStore(settings.root, settings.namespace, budget_bytes=settings.budget_bytes,
                                   grace_s=settings.grace_s)
        self._to_load: list[str] = []
        self._device = vllm_config.device_config.device_type

    # the scheduler's half

    def has_cache_item(self, identifier: str) -> bool:
        return self._store.has(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        key = request.mm_features[index].identifier
        if self._store.has(key):
            self._to_load.append(key)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        order, self._to_load = LoadOrder(keys=self._to_load), []
        return order

    # the model runner's half

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        order = self._get_connector_metadata()
        assert isinstance(order, LoadOrder)
        for key in order.keys:
            if key not in encoder_cache:
                # the scheduler marked the entry used just now: eviction spares it for the grace
                encoder_cache[key] = safetensors.torch.load_file(self._store.path(key), device=self._device)[TENSOR]

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._store.path(mm_hash).exists():
            return
        output = encoder_cache[mm_hash].detach().cpu().contiguous()
        try:
            self._store.write(mm_hash, lambda path: safetensors.torch.save_file({TENSOR: output}, path))
        except OSError as error:  # a full disk loses the entry, not the request
            log.warning("encoder output not stored (%s): %s", mm_hash, error)
