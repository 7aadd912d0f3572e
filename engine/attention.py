"""Paged attention. K/V live only in the block pool; each step writes the new tokens' K/V into
their slots, then every sequence attends over its own blocks through its block table.

The per-step metadata is set once by the model runner in a scoped context (`use_metadata`) so the
model's forward signatures stay plain. One torch implementation serves CPU and CUDA: the decode
path reads K/V in place through the block tables with our C kernel on the CPU (engine/csrc), or
gathers each sequence's blocks into a padded batch for one batched SDPA call elsewhere; prefill
chunks run one SDPA call per sequence.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels


@dataclass
class PrefillSeq:
    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens attended to (cached + this step)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot of each token's K/V
    num_decode: int  # the first num_decode rows are one-token sequences
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor | None = None  # [B] tokens each decode attends to
    decode_mask: torch.Tensor | None = None  # torch path only, made by the first layer that needs it
    prefills: list[PrefillSeq] = field(default_factory=list)


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def use_metadata(meta: AttentionMetadata):
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, Hkv, D], bound by the runner
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        meta = _current
        T = q.shape[0]
        if self.k_cache.numel():
            kc = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
            kc.index_copy_(0, meta.slot_mapping, k)
            self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = q.new_empty(T, self.num_heads, self.head_dim)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(q[:nd], meta)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], seq)
        return out.view(T, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if cpu_kernels.supports(q):
            return cpu_kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                      meta.decode_seq_lens, self.scale)
        B, nb = meta.decode_block_tables.shape
        bs = self.k_cache.shape[1]
        if meta.decode_mask is None:  # the C kernel stops at each length itself and needs no mask
            valid = torch.arange(nb * bs, device=q.device) < meta.decode_seq_lens.unsqueeze(1)
            meta.decode_mask = valid[:, None, None, :]
        keys = self.k_cache[meta.decode_block_tables].view(B, nb * bs, self.num_kv_heads, self.head_dim)
        values = self.v_cache[meta.decode_block_tables].view(B, nb * bs, self.num_kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if seq.ctx_len == seq.q_len:  # nothing cached before this chunk: plain causal attention
            keys, values, mask, causal = k, v, None, True
        else:
            keys = self.k_cache[seq.block_ids].flatten(0, 1)[:seq.ctx_len]
            values = self.v_cache[seq.block_ids].flatten(0, 1)[:seq.ctx_len]
            offset = seq.ctx_len - seq.q_len
            rows = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(seq.ctx_len, device=q.device).unsqueeze(0) <= rows
            causal = False
        o = F.scaled_dot_product_attention(
            qt, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
