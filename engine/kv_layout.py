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
