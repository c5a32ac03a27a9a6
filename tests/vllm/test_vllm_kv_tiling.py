"""`connector.vllm.kv_pages.cpu_tiling` against vLLM's own CPU cache kernel: for each
attention kernel this host runs (`vec`, `vec16`, and `amx` where the CPU has AMX tiles),
vLLM's `cpu_attn_reshape_and_cache` writes every (token, dimension) of a block, and each
tile-aligned token range of each run that the tiling names (what a transfer between unlike
block sizes moves as one piece) holds exactly those tokens' share of that run's dimensions.

A tiling that is wrong for one kernel scrambles K and V wherever blocks are cut (prefill
and decode with other block sizes) on hosts that run it; equal block sizes move whole
blocks and never show it. So each kernel is checked where it runs, and the AMX one is
skipped, said so, where the CPU has no AMX.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from connector.kv_geometry import RankSlice, layer_major  # noqa: E402
from connector.vllm.amx import amx_state_granted, cpu_has_amx, request_amx_state  # noqa: E402
from connector.vllm.kv_pages import cpu_tiling  # noqa: E402

DTYPE_NBYTES = 2  # bfloat16
SHAPES = [(head_size, block_size) for head_size in (32, 64, 128) for block_size in (32, 64, 128)]


def kernels() -> list[pytest.param]:
    amx = cpu_has_amx()
    return [pytest.param("vec", id="vec"), pytest.param("vec16", id="vec16"),
            pytest.param("amx", id="amx", marks=pytest.mark.skipif(
                not amx, reason="this CPU has no AMX tiles: vLLM's AMX kernel is not run here (CI hosts may have it)"))]


def cached(isa: str, head_size: int, block_size: int, values: torch.Tensor) -> list[int]:
    """One block of one head as vLLM's kernel `isa` caches K = V = `values` (tokens x dims),
    as a flat list of the page's elements (K region, then V region)."""
    page = torch.zeros(1, 1, block_size, 2 * head_size, dtype=torch.bfloat16)
    key_cache, value_cache = page.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    rows = values.to(torch.bfloat16).reshape(block_size, 1, head_size).contiguous()
    ops.cpu_attn_reshape_and_cache(rows, rows, key_cache, value_cache, torch.arange(block_size), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return page.reshape(-1).float().long().tolist()


@pytest.mark.parametrize("isa", kernels())
@pytest.mark.parametrize("head_size, block_size", SHAPES, ids=[f"h{h}-bs{b}" for h, b in SHAPES])
def test_each_tile_of_each_run_holds_exactly_its_tokens_share(isa: str, head_size: int, block_size: int) -> None:
    if isa == "amx":
        request_amx_state()  # what every vLLM process of a Tandem worker does first
        assert amx_state_granted(), "AMX tile state was not granted"
    tokens = torch.arange(block_size).float()[:, None].expand(block_size, head_size)  # exact in bfloat16 (<= 256)
    dims = torch.arange(head_size).float()[None, :].expand(block_size, head_size)
    token_of = cached(isa, head_size, block_size, tokens)
    dim_of = cached(isa, head_size, block_size, dims)
    tiling = cpu_tiling(isa, head_size, block_size)
    geometry = layer_major(RankSlice(rank=0, first_layer=0, num_layers=1, first_head=0, num_heads=1), num_blocks=1,
                           block_size=block_size, token_nbytes=head_size * DTYPE_NBYTES, tiling=tiling)
    geometry.validate()
    for kv in (0, 1):
        groups, tile = geometry.tiling(kv)
        share = head_size // groups  # elements of one token in one run
        for group in range(groups):
            for first in range(0, block_size, tile):
                start = geometry.address(0, 0, 0, kv, first, group) // DTYPE_NBYTES
                held = set(zip(token_of[start:start + tile * share], dim_of[start:start + tile * share], strict=True))
                expected = {(token, dim) for token in range(first, first + tile)
                            for dim in range(group * share, (group + 1) * share)}
                assert held == expected, (
                    f"{isa} {'KV'[kv]}: run {group}, tokens {first}-{first + tile - 1} hold other elements "
                    f"(tiling {tiling})")
