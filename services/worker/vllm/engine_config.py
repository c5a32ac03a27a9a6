"""What `VllmEngine` tells vLLM when it starts it (`engine_args`) and what it learns back
once it runs (`engine_info`: the layout in the compatibility hash, capacity, limits).

A worker at tensor-parallel degree N runs N model-worker processes (vLLM's multiprocessing
executor; one rank per device on GPUs, per core set on CPU): its layout names the model's
layers and KV heads in total and the degree, which a mapping converts for peers of another
shape (`shared.compat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm
from vllm.config import KVEventsConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs

from connector.vllm import encoder_cache
from services.worker.engine import EngineInfo
from services.worker.vllm import sampling
from services.worker.vllm.attention import attention_isa
from services.worker.vllm.kv_events import KvEventEndpoints
from services.worker.vllm.options import VllmEngineOptions
from shared.compat import KvLayout

if TYPE_CHECKING:
    from connector.vllm.kv_link import ConnectorLink


def engine_args(options: VllmEngineOptions, endpoints: KvEventEndpoints, link: ConnectorLink | None) -> AsyncEngineArgs:
    connector = {} if link is None else dict(kv_transfer_config=link.transfer_config(),
                                             worker_extension_cls=link.worker_extension)
    if options.encoder_cache is not None:
        connector["ec_transfer_config"] = encoder_cache.transfer_config(options.encoder_cache)
    parallel = {} if options.tensor_parallel == 1 else dict(tensor_parallel_size=options.tensor_parallel,
                                                            distributed_executor_backend="mp")
    return AsyncEngineArgs(
        model=options.model_dir, served_model_name=options.model_name, dtype=options.dtype,
        seed=options.seed, max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        kv_cache_memory_bytes=options.kv_cache_bytes, block_size=options.block_size,
        enable_prefix_caching=True, enforce_eager=options.enforce_eager,
        structured_outputs_config=sampling.structured_outputs_config(options.json_any_whitespace),
        logits_processors=sampling.LOGITS_PROCESSORS,
        otlp_traces_endpoint=options.otlp_traces_endpoint or None,
        **(dict(enable_lora=True, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
           if options.max_loras else {}),
        disable_log_stats=True,  # default loggers off; Tandem's own logger below still turns stats on
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoints.publish,
            replay_endpoint=endpoints.replay, buffer_steps=options.kv_event_buffer_steps, topic=""),
        **parallel, **connector)


def engine_info(options: VllmEngineOptions, config: VllmConfig) -> EngineInfo:
    model = config.model_config
    cache = config.cache_config
    kv_dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    layout = KvLayout(model=options.model_name, model_version=options.model_version,
                      dtype=str(kv_dtype).removeprefix("torch."), block_size=cache.block_size,
                      num_layers=model.get_total_num_hidden_layers(), num_kv_heads=model.get_total_num_kv_heads(),
                      head_size=model.get_head_size(), engine=kv_engine_tag(config.device_config.device_type),
                      tensor_parallel=config.parallel_config.tensor_parallel_size,
                      # the kernel's tiles of a block's K and V (`connector.vllm.kv_pages.cpu_tiling`): an AMX
                      # host's blocks are not a vectorised kernel's
                      attention=f"full-{attention_isa(config)}")
    assert cache.num_gpu_blocks, "vLLM reported no KV blocks after start-up"
    return EngineInfo(engine="vllm", model=options.model_name, layout=layout,
                      kv_blocks=cache.num_gpu_blocks - 1,  # one block is vLLM's null block
                      max_num_seqs=config.scheduler_config.max_num_seqs,
                      max_model_len=model.max_model_len, vocab_size=model.get_vocab_size())


def kv_engine_tag(device_type: str) -> str:
    """The engine part of the compatibility hash: vLLM's KV cache layout differs between its
    versions and platforms (CPU and CUDA attention back-ends page KV differently)."""
    return f"vllm-{vllm.__version__}-{device_type}"
