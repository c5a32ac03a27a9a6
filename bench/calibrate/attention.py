"""Decode attention as a serving engine runs it, for `bench.calibrate.measure`.

transformers' stock SDPA path attends a decode step against a `StaticCache` over the whole
preallocated length with a mask, and copies each KV head for every query head it serves
(`repeat_kv`) because a mask rules out SDPA's native grouped-query mode. Serving engines
(vLLM's paged FlashAttention) read only the filled KV, once. `install(torch)` replaces the
"sdpa" attention function, in this process only, by one that, for a one-token query with a
known filled length, attends over exactly that prefix with grouped-query attention in the
kernel; everything else (prefill) goes to the stock function. The measuring code sets the
filled length (`state["filled"]`) before building each decode step; a plain Python int, so
the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any


def install(torch: Any) -> dict[str, int | None]:
    from transformers import AttentionInterface

    stock = AttentionInterface._global_mapping["sdpa"]
    state: dict[str, int | None] = {"filled": None}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                  scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
        filled = state["filled"]
        if query.shape[2] == 1 and filled is not None and key.shape[2] >= filled:
            out = sdpa(query, key[:, :, :filled], value[:, :, :filled], scale=scaling,
                       enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    AttentionInterface.register("sdpa", attention)
    return state
