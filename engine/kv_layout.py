"""The KV pool's layout, one layer's: V token by token [num_blocks, block_size, Hkv, D], K in
dimension pairs [num_blocks, Hkv, D/2, block_size, 2], so that one vector load holds a pair of
dimensions of 16 consecutive tokens and decode scores vectorise across tokens
(csrc/paged_attention.c) instead of summing each token's products across lanes. `key_rows` and
`key_pairs` convert."""
from __future__ import annotations

import torch


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
    """The shapes of one layer's K and V pools."""
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd: K is stored in dimension pairs")
    return ((num_blocks, num_kv_heads, head_dim // 2, block_size, 2), (num_blocks, block_size, num_kv_heads, head_dim))


def key_rows(k_blocks: torch.Tensor) -> torch.Tensor:
    """K blocks as the pool holds them [..., Hkv, D/2, block_size, 2] -> [..., block_size, Hkv, D] (a copy)."""
    n = k_blocks.dim() - 4
    *lead, Hkv, half, bs, _ = k_blocks.shape
    return k_blocks.permute(*range(n), n + 2, n, n + 1, n + 3).reshape(*lead, bs, Hkv, 2 * half)


def key_pairs(keys: torch.Tensor) -> torch.Tensor:
    """K blocks [..., block_size, Hkv, D] -> the pool's [..., Hkv, D/2, block_size, 2] (a copy)."""
    n = keys.dim() - 3
    *lead, bs, Hkv, D = keys.shape
    return keys.reshape(*lead, bs, Hkv, D // 2, 2).permute(*range(n), n + 1, n + 2, n, n + 3).contiguous()


# --kv-cache-dtype int8: each token's K and V row of each kv head rounded to int8 with its own scale
# (max |x| / 127), kept in the block beside the values: one layer's K (or V) pool is [num_blocks, bytes],
# a block its int8 values, K in dimension quads [Hkv, D/4, block_size, 4] (the integer dot products take
# 4 at a time), V as above, then the scales, fp32, [Hkv, block_size] for K and [block_size, Hkv] for V
# (csrc/attention_int8.h reads the same bytes).


def int8_block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's int8 K (or V) pool: values and scales."""
    return block_size * num_kv_heads * (head_dim + 4)


def int8_views(pool: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int,
               keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 pool [num_blocks, bytes] as (values, scales), views: K's values [num_blocks, Hkv, D/4,
    block_size, 4] and scales [num_blocks, Hkv, block_size]; V's [num_blocks, block_size, Hkv, D] and
    [num_blocks, block_size, Hkv]."""
    if head_dim % 4:
        raise ValueError(f"head_dim {head_dim}: int8 K is stored in dimension quads")
    n, count = pool.shape[0], block_size * num_kv_heads * head_dim
    shape = (n, num_kv_heads, head_dim // 4, block_size, 4) if keys else (n, block_size, num_kv_heads, head_dim)
    values = pool[:, :count].view(torch.int8).view(shape)
    scales = pool[:, count:].view(torch.float32)
    return values, scales.view((n, num_kv_heads, block_size) if keys else (n, block_size, num_kv_heads))


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], fp32 scales [...]): x ~ q * scale, scale = max |x| / 127, rounded to
    nearest even (csrc/attention_int8.h's quantize_head)."""
    x = x.float()
    top = x.abs().amax(dim=-1)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    return torch.round(x * inv.unsqueeze(-1)).to(torch.int8), top / 127


def dequantize(values: torch.Tensor, scales: torch.Tensor, keys: bool, dtype: torch.dtype) -> torch.Tensor:
    """int8_views' values and scales of some blocks -> the same blocks in `dtype` in the layout of a pool
    of that dtype (K in pairs: key_rows reads it)."""
    if not keys:
        return (values.float() * scales[..., None]).to(dtype)
    *lead, Hkv, quads, bs, _ = values.shape
    rows = (values.float() * scales[..., :, None, :, None]).to(dtype)  # [..., Hkv, D/4, bs, 4]
    n = len(lead)
    return key_pairs(rows.permute(*range(n), n + 2, n, n + 1, n + 3).reshape(*lead, bs, Hkv, 4 * quads))
