"""Paged attention. K/V live only in the block pool; each step writes the new tokens' K/V into
their slots, then every sequence attends over its own blocks through its block table.

The per-step metadata is set once by the model runner in a scoped context (`use_metadata`) so the
model's forward signatures stay plain. One torch implementation serves CPU and CUDA: decode rows
(and on the CPU the rows of prompt chunks with short contexts, each as a one-token sequence over its
own prefix) read K/V in place through the block tables with our C kernel on the CPU (engine/csrc),
or gather each sequence's blocks into a padded batch for one batched SDPA call elsewhere; other
prompt chunks run one SDPA call per sequence.

The pool's layout is engine/kv_layout.py's; a prefix shared by many decodes is attended once for
all of them (engine/cascade.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cascade import SharedPrefix, prefix_attention, prefix_operands
from engine.kv_layout import dequantize, int8_block_bytes, int8_views, key_rows, quantize_heads


@dataclass
class PrefillSeq:
    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens attended to (cached + this step)
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot of each token's K/V
    num_decode: int  # the first num_decode rows are one-token sequences (decodes)
    # The first R rows (the decodes, then rows of short prompt chunks) are attended one by one, each
    # as a one-token sequence over its own prefix:
    row_block_tables: torch.Tensor | None = None  # [R, max_blocks], padded with block 0
    row_seq_lens: torch.Tensor | None = None  # [R] tokens each row attends to
    row_masks: dict = field(default_factory=dict)  # torch path only: window (None: all) -> the rows' mask
    row_starts: dict = field(default_factory=dict)  # window -> [R] each row's first token in the window
    prefills: list[PrefillSeq] = field(default_factory=list)  # the other prompt chunks (SDPA)
    shared: SharedPrefix | None = None  # rows whose tables start with the same blocks (C kernel path)
    kernel_threads: int | None = None  # the C decode kernel's threads (None: cpu_kernels.threads())


def layer_window(cfg, index: int) -> int | None:
    """Layer `index`'s sliding window from its transformers config: every layer's for Mistral
    (`sliding_window`), the "sliding_attention" layers' where the config lists `layer_types` (Qwen2
    and Qwen3 with use_sliding_window, which leave `sliding_window` None without it); None: the layer
    attends to every earlier token."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window or (types is not None and types[index] != "sliding_attention"):
        return None
    return int(window)


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def use_metadata(meta: AttentionMetadata):
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def step_metadata() -> AttentionMetadata | None:
    """The metadata of the model step in progress (None outside one)."""
    return _current


def decode_rows() -> int | None:
    """How many leading rows of the forward in progress are decodes (one token of one sequence);
    None outside a model step."""
    return None if _current is None else _current.num_decode


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int | None = None, softcap: float | None = None) -> None:
        """window: a sliding window (Mistral; Qwen2's and Gemma's local layers): each token attends
        to the last `window` tokens, itself included (transformers: kv > q - window); None: all.
        softcap: scores become softcap * tanh(score / softcap) (Gemma 2); such a layer takes the
        torch path by hand (neither our kernels nor SDPA cap)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window, self.softcap = scale, window, softcap
        self.k_cache = torch.empty(0)  # kv_cache_shapes, or int8 pools: bound by the runner (bind_cache)
        self.v_cache = torch.empty(0)
        self.int8: tuple | None = None  # int8 pools: (block_size, K's int8_views, V's)
        self._prefix: tuple = (None, None, None)  # (content, keys, values) of the last shared prefix
        self.kernels = cpu_kernels.serves_here() and softcap is None  # the C path's availability, asked once
        self.stores = cpu_kernels.serves_here()

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, int8: bool = False) -> None:
        """This layer's K and V pools: kv_layout.kv_cache_shapes, or with `int8` pools [num_blocks, bytes]
        (kv_layout.int8_views)."""
        self.k_cache, self.v_cache, self.int8 = k_cache, v_cache, None
        if int8:
            Hkv, D = self.num_kv_heads, self.head_dim
            bs = k_cache.shape[1] // int8_block_bytes(1, Hkv, D)
            self.int8 = (bs, int8_views(k_cache, bs, Hkv, D, keys=True), int8_views(v_cache, bs, Hkv, D, keys=False))

    @property
    def block_size(self) -> int:
        return self.int8[0] if self.int8 else self.v_cache.shape[1]

    def _key_blocks(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K of blocks `ids` in the bf16 pool's layout (int8 pools: dequantized, a copy)."""
        return self.k_cache[ids] if self.int8 is None else dequantize(*(t[ids] for t in self.int8[1]), True, dtype)

    def _value_blocks(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.v_cache[ids] if self.int8 is None else dequantize(*(t[ids] for t in self.int8[2]), False, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        meta = _current
        T = q.shape[0]
        if self.k_cache.numel():
            self._store(k, v, meta.slot_mapping)
        out = q.new_empty(T, self.num_heads, self.head_dim)
        rows = 0 if meta.row_seq_lens is None else meta.row_seq_lens.shape[0]
        if rows:
            self._decode(q[:rows], meta, out[:rows])  # in place
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], seq)
        return out.view(T, self.num_heads * self.head_dim)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The new tokens' K/V into their slots of the block pool."""
        caches = self.k_cache.is_contiguous() and self.v_cache.is_contiguous()
        kernel = self.stores and cpu_kernels.supports(k) and k.dtype == v.dtype and caches \
            and cpu_kernels.heads_contiguous(k) and cpu_kernels.heads_contiguous(v)
        if self.int8:
            return self._store_int8(k, v, slots, kernel)
        if kernel and k.dtype == self.k_cache.dtype:
            cpu_kernels.kv_store(k, v, self.k_cache, self.v_cache, slots)  # one call, no copies of the views
            return
        bs = self.v_cache.shape[1]
        by_token = self.k_cache.permute(0, 3, 1, 2, 4)  # a view [num_blocks, block_size, Hkv, D/2, 2]
        by_token[slots // bs, slots % bs] = k.reshape(k.shape[0], self.num_kv_heads, self.head_dim // 2, 2)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def _store_int8(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kernel: bool) -> None:
        bs, (k_values, k_scales), (v_values, v_scales) = self.int8
        if kernel and self.head_dim <= 512:
            cpu_kernels.kv_store_int8(k, v, self.k_cache, self.v_cache, slots, bs)
            return
        blocks, within = slots // bs, slots % bs
        qk, sk = quantize_heads(k)
        qv, sv = quantize_heads(v)
        k_values.permute(0, 3, 1, 2, 4)[blocks, within] = qk.reshape(k.shape[0], self.num_kv_heads, -1, 4)
        k_scales[blocks, :, within] = sk
        v_values[blocks, within], v_scales[blocks, within] = qv, sv

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the rows attended one by one (meta.row_*), written into `out` when given (the
        C kernel writes there directly, and reads q's rows where they lie: no copies)."""
        out = q.new_empty(q.shape) if out is None else out
        starts = self._starts(meta)
        int8 = (self.block_size, self.num_kv_heads) if self.int8 else None
        if cpu_kernels.supports(q) and self.kernel_serves(q.dtype):
            if starts is not None:  # a window: no cascade (the shared prefix falls out of it)
                prefix = (starts, None, None, None)
            else:
                prefix = self._cascade_prefix(q, meta) if meta.shared is not None else None
            return cpu_kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.row_block_tables,
                                                      meta.row_seq_lens, self.scale, out, prefix=prefix,
                                                      threads=meta.kernel_threads, int8=int8)
        B, nb = meta.row_block_tables.shape
        bs = self.block_size
        if self.window not in meta.row_masks:  # the C kernel stops at each length itself and needs no mask
            tokens = torch.arange(nb * bs, device=q.device)
            valid = tokens < meta.row_seq_lens.unsqueeze(1)
            if starts is not None:
                valid &= tokens >= starts.unsqueeze(1)
            meta.row_masks[self.window] = valid[:, None, None, :]
        keys = key_rows(self._key_blocks(meta.row_block_tables, q.dtype)).view(B, nb * bs, self.num_kv_heads,
                                                                              self.head_dim)
        values = self._value_blocks(meta.row_block_tables, q.dtype).view(B, nb * bs, self.num_kv_heads, self.head_dim)
        o = self._sdpa(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), meta.row_masks[self.window])
        return out.copy_(o.squeeze(2))

    def kernel_serves(self, dtype: torch.dtype) -> bool:
        """Whether the C kernel attends this layer's rows of `dtype` (fp32 or bf16 ones): else the torch
        path, which gathers every row's whole context."""
        return self.kernels and (self.int8 is None or self.int8_kernel(dtype))

    def int8_kernel(self, dtype: torch.dtype) -> bool:
        """Whether the C kernel reads int8 pools for queries of `dtype` (bf16 on AVX-512 BF16 and VNNI, fp32 on
        AVX2; head_dim a multiple of 16 up to 512)."""
        feature = "quant_bf16" if dtype == torch.bfloat16 else "f32_attention"
        return self.head_dim % 16 == 0 and self.head_dim <= 512 and cpu_kernels.has(feature)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False) -> torch.Tensor:
        """SDPA of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D]; with a softcap, the same by hand."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=True)
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1).float(), v.repeat_interleave(G, dim=1).float()
        scores = torch.tanh(q.float() @ k.transpose(-1, -2) * (self.scale / self.softcap)) * self.softcap
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).to(q.dtype)

    def _starts(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """Each row's first token inside this layer's window (None without one), once per step."""
        if self.window is None:
            return None
        if self.window not in meta.row_starts:
            meta.row_starts[self.window] = (meta.row_seq_lens - self.window).clamp(min=0)
        return meta.row_starts[self.window]

    def _cascade_prefix(self, q: torch.Tensor, meta: AttentionMetadata) -> tuple:
        """The cascade: the shared prefix is read once for all the rows that share it (one matrix
        product); the kernel then attends each row's own suffix and merges the two partial softmaxes
        exactly (log-sum-exp). Returns the kernel's `prefix` argument."""
        shared = meta.shared
        keys, values = self.shared_operands(shared, q.dtype)
        prefix_out, prefix_lse = prefix_attention(q[shared.rows], keys, values, self.scale, meta.kernel_threads)
        return shared.starts, shared.prefix_row, prefix_out, prefix_lse

    def shared_operands(self, shared: SharedPrefix, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K and V as prefix_attention takes them (cascade.prefix_operands), kept
        until the prefix changes: its blocks are full, and full blocks never change."""
        content, keys, values = self._prefix
        if content != shared.content:
            keys, values = prefix_operands(self._key_blocks(shared.block_ids, dtype),
                                           self._value_blocks(shared.block_ids, dtype))
            self._prefix = (shared.content, keys, values)
        return keys, values

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if self.int8:  # the chunk's own K/V as the pool holds them: the same whether cached or fresh
            k, v = (dequantize(*quantize_heads(x), False, x.dtype) for x in (k, v))
        if seq.ctx_len == seq.q_len and self.window is None:  # nothing cached before: plain causal attention
            keys, values, mask, causal = k, v, None, True
        else:
            if seq.ctx_len == seq.q_len:
                keys, values = k, v
            else:
                keys = key_rows(self._key_blocks(seq.block_ids, q.dtype)).flatten(0, 1)[:seq.ctx_len]
                values = self._value_blocks(seq.block_ids, q.dtype).flatten(0, 1)[:seq.ctx_len]
            offset = seq.ctx_len - seq.q_len
            rows = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + offset
            tokens = torch.arange(seq.ctx_len, device=q.device).unsqueeze(0)
            mask = tokens <= rows
            if self.window is not None:
                mask &= tokens > rows - self.window
            causal = False
        o = self._sdpa(qt, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), mask, causal)
        return o.squeeze(0).transpose(0, 1)
