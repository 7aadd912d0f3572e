"""Paged attention. K/V live only in the block pool; each step writes the new tokens' K/V into
their slots, then every sequence attends over its own blocks through its block table.

The per-step metadata is set once by the model runner in a scoped context (`use_metadata`) so the
model's forward signatures stay plain. One torch implementation serves CPU and CUDA: decode rows
(and on the CPU the rows of prompt chunks with short contexts, each as a one-token sequence over its
own prefix) read K/V in place through the block tables with our C kernel on the CPU (engine/csrc),
or gather each sequence's blocks into a padded batch for one batched SDPA call elsewhere; other
prompt chunks run one SDPA call per sequence.

The pool's layout: V token by token [num_blocks, block_size, Hkv, D], K in dimension pairs
[num_blocks, Hkv, D/2, block_size, 2], so that one vector load holds a pair of dimensions of 16
consecutive tokens and decode scores vectorise across tokens (csrc/paged_attention.c) instead of
summing each token's products across lanes. `key_rows` and `key_pairs` convert.
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


@dataclass
class SharedPrefix:
    """Leading blocks that several decoding sequences share (a system prompt, mostly)."""
    block_ids: torch.Tensor  # [k] the shared blocks, in order
    rows: torch.Tensor  # decode rows that share them
    starts: torch.Tensor  # [B] where each decode's own part begins: k * block_size for those rows, else 0
    prefix_row: torch.Tensor  # [B] each decode's row in `rows`, -1 if it does not share
    content: tuple  # (chain hash of the last shared block, block ids): names the K/V, reused across steps


# Measured (bench/attention.py, SmolLM2's heads, bf16 on an AVX-512 BF16 EPYC, 150 own tokens per
# row). Since K lies in dimension pairs the per-sequence kernel vectorises across tokens as our prefix
# kernel (csrc/prefix_attention.c) does, and shared blocks read by every row stay in the caches: the
# cascade against it, attention alone, at 16 / 32 / 64 rows: 304-token prefix 0.6 / 0.95 / 1.0x
# (30 layers' caches, as in a step: 1.0x); 1024 tokens 0.8 / 1.33 / 1.9x; 2048 tokens 1.3 / 1.5 /
# 1.25x. Hence from 1024 tokens shared by 32 rows. (Before, with K token by token, a 304-token prefix
# paid 1.4x at 64 rows.) Torch's flash attention for the prefix (other head sizes, fp32 models) lost
# to the vectorised per-sequence kernels (fp32 on AVX2: a batch-64 step 215 ms per sequence against
# 262 cascaded; bf16: 0.52x at 64 rows on 304 tokens, ~0.9x on 2048-4096): there it waits for
# prefixes of 8192 tokens. Where the per-sequence kernel walks K or V a token at a time (a bf16 model
# without AVX-512 BF16 or with head_dim != 64, an fp32 one without AVX2) a 304-token prefix paid
# from 16 rows, hence 256 tokens there.
MIN_SHARING_ROWS = 32
MIN_SHARED_TOKENS = 8192
MIN_SHARED_TOKENS_KERNEL = 1024
MIN_SHARED_TOKENS_PLAIN = 256


def shared_tokens_needed(dtype: torch.dtype, head_dim: int) -> int:
    """The prefix length from which the cascade pays for a model of `dtype` and `head_dim` on this
    CPU, by which kernels would take the prefix and the whole sequences (see above)."""
    if cpu_kernels.prefix_kernel(dtype, head_dim, 16):
        return MIN_SHARED_TOKENS_KERNEL if head_dim == 64 else MIN_SHARED_TOKENS_PLAIN
    return MIN_SHARED_TOKENS if dtype in cpu_kernels.quant_matmul_dtypes() else MIN_SHARED_TOKENS_PLAIN


def find_shared_prefix(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                       block_hashes: list[list[int]] | None = None,
                       min_tokens: int | None = None) -> SharedPrefix | None:
    """The longest run of leading blocks common to the decodes that share the most common first
    block, stopping before each one's last token (which must stay its own); None if too few share.
    block_hashes: each decode's chain hashes, which name the shared blocks' content; without them
    (prefix caching off) the prefix's operands could not be reused across steps, and there is no gain.
    min_tokens: the shortest prefix that pays (shared_tokens_needed; MIN_SHARED_TOKENS if None)."""
    if not block_hashes or len(block_hashes) < MIN_SHARING_ROWS:
        return None
    first = table[:, 0]
    rows = (first == first.mode().values).nonzero().squeeze(1)
    if rows.numel() < MIN_SHARING_ROWS:
        return None
    sub = table[rows]
    k = int((sub == sub[0]).all(0).cumprod(0).sum())
    k = min(k, int(((seq_lens[rows] - 1) // block_size).min()))
    if k == 0 or k * block_size < (MIN_SHARED_TOKENS if min_tokens is None else min_tokens):
        return None
    starts = torch.zeros_like(seq_lens)
    starts[rows] = k * block_size
    prefix_row = torch.full_like(seq_lens, -1)
    prefix_row[rows] = torch.arange(rows.numel())
    hashes = block_hashes[int(rows[0])]
    if len(hashes) < k:
        return None
    block_ids = sub[0, :k]
    return SharedPrefix(block_ids, rows, starts, prefix_row, (hashes[k - 1], tuple(block_ids.tolist())))


def prefix_operands(k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared K/V blocks (the pool's layouts) as the operands prefix_attention takes: for our
    kernel (cpu_kernels.prefix_kernel) K as pairs of dimensions [Hkv, D/2, P, 2] and V as pairs of
    tokens [Hkv, P/2, D, 2]; else [1, Hkv, P, D] each, for torch's flash attention."""
    blocks, bs, Hkv, D = v_blocks.shape
    P = blocks * bs
    if cpu_kernels.prefix_kernel(v_blocks.dtype, D, P):
        return (k_blocks.permute(1, 2, 0, 3, 4).reshape(Hkv, D // 2, P, 2),
                v_blocks.reshape(P // 2, 2, Hkv, D).permute(2, 0, 3, 1).contiguous())
    keys, values = key_rows(k_blocks).reshape(P, Hkv, D), v_blocks.reshape(P, Hkv, D)
    return keys.transpose(0, 1).unsqueeze(0).contiguous(), values.transpose(0, 1).unsqueeze(0).contiguous()


def prefix_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     threads: int | None = None):
    """All sharing queries q [S, H, D] against the shared prefix (prefix_operands) at once, as matrix
    products: our kernel (csrc/prefix_attention.c) where it serves, else per kv head its S * G
    queries as one call of torch's CPU flash attention, which also returns the log-sum-exp.
    Returns the partial (out [S, H, D] fp32, lse [S, H] fp32)."""
    S, H, D = q.shape
    if cpu_kernels.prefix_kernel(keys.dtype, D, keys.shape[2]):  # as prefix_operands chose (P is dim 2 in both)
        return cpu_kernels.prefix_attention(q, keys, values, scale, threads)
    Hkv = keys.shape[1]
    G = H // Hkv
    queries = q.reshape(S, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, S * G, D)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(queries, keys, values, scale=scale)[:2]
    return (out.reshape(Hkv, S, G, D).transpose(0, 1).reshape(S, H, D).float(),
            lse.reshape(Hkv, S, G).transpose(0, 1).reshape(S, H))


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
        self.k_cache = torch.empty(0)  # kv_cache_shapes, bound by the runner
        self.v_cache = torch.empty(0)
        self._prefix: tuple = (None, None, None)  # (content, keys, values) of the last shared prefix
        self.kernels = cpu_kernels.serves_here() and softcap is None  # the C path's availability, asked once
        self.stores = cpu_kernels.serves_here()

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
        if self.stores and cpu_kernels.supports(k) and k.dtype == self.k_cache.dtype == v.dtype and caches \
                and cpu_kernels.heads_contiguous(k) and cpu_kernels.heads_contiguous(v):
            cpu_kernels.kv_store(k, v, self.k_cache, self.v_cache, slots)  # one call, no copies of the views
            return
        bs = self.v_cache.shape[1]
        by_token = self.k_cache.permute(0, 3, 1, 2, 4)  # a view [num_blocks, block_size, Hkv, D/2, 2]
        by_token[slots // bs, slots % bs] = k.reshape(k.shape[0], self.num_kv_heads, self.head_dim // 2, 2)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the rows attended one by one (meta.row_*), written into `out` when given (the
        C kernel writes there directly, and reads q's rows where they lie: no copies)."""
        out = q.new_empty(q.shape) if out is None else out
        starts = self._starts(meta)
        if self.kernels and cpu_kernels.supports(q):
            if starts is not None:  # a window: no cascade (the shared prefix falls out of it)
                prefix = (starts, None, None, None)
            else:
                prefix = self._cascade_prefix(q, meta) if meta.shared is not None else None
            return cpu_kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.row_block_tables,
                                                      meta.row_seq_lens, self.scale, out, prefix=prefix,
                                                      threads=meta.kernel_threads)
        B, nb = meta.row_block_tables.shape
        bs = self.v_cache.shape[1]
        if self.window not in meta.row_masks:  # the C kernel stops at each length itself and needs no mask
            tokens = torch.arange(nb * bs, device=q.device)
            valid = tokens < meta.row_seq_lens.unsqueeze(1)
            if starts is not None:
                valid &= tokens >= starts.unsqueeze(1)
            meta.row_masks[self.window] = valid[:, None, None, :]
        keys = key_rows(self.k_cache[meta.row_block_tables]).view(B, nb * bs, self.num_kv_heads, self.head_dim)
        values = self.v_cache[meta.row_block_tables].view(B, nb * bs, self.num_kv_heads, self.head_dim)
        o = self._sdpa(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), meta.row_masks[self.window])
        return out.copy_(o.squeeze(2))

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
        content, keys, values = self._prefix
        if content != shared.content:  # full blocks never change: the operands serve until the prefix does
            keys, values = prefix_operands(self.k_cache[shared.block_ids], self.v_cache[shared.block_ids])
            self._prefix = (shared.content, keys, values)
        prefix_out, prefix_lse = prefix_attention(q[shared.rows], keys, values, self.scale, meta.kernel_threads)
        return shared.starts, shared.prefix_row, prefix_out, prefix_lse

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if seq.ctx_len == seq.q_len and self.window is None:  # nothing cached before: plain causal attention
            keys, values, mask, causal = k, v, None, True
        else:
            if seq.ctx_len == seq.q_len:
                keys, values = k, v
            else:
                keys = key_rows(self.k_cache[seq.block_ids]).flatten(0, 1)[:seq.ctx_len]
                values = self.v_cache[seq.block_ids].flatten(0, 1)[:seq.ctx_len]
            offset = seq.ctx_len - seq.q_len
            rows = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + offset
            tokens = torch.arange(seq.ctx_len, device=q.device).unsqueeze(0)
            mask = tokens <= rows
            if self.window is not None:
                mask &= tokens > rows - self.window
            causal = False
        o = self._sdpa(qt, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), mask, causal)
        return o.squeeze(0).transpose(0, 1)
