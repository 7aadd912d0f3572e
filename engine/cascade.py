"""The cascade: a prefix that many decoding sequences share (a system prompt, mostly) is attended
once for all of them as a matrix product, and each row's own suffix by the per-sequence kernel;
the two partial softmaxes merge exactly (engine/attention.py's PagedAttention._cascade_prefix).
Here: when it pays, which blocks are shared, and the prefix's side of it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.kv_layout import key_rows


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
    from engine.quant import cpu_matmul  # here: reading a checkpoint imports this module, and no quantization code

    if cpu_kernels.prefix_kernel(dtype, head_dim, 16):
        return MIN_SHARED_TOKENS_KERNEL if head_dim == 64 else MIN_SHARED_TOKENS_PLAIN
    return MIN_SHARED_TOKENS if dtype in cpu_matmul.quant_matmul_dtypes() else MIN_SHARED_TOKENS_PLAIN


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
    if int(seq_lens.max()) <= (MIN_SHARED_TOKENS if min_tokens is None else min_tokens):
        return None  # no prefix that long (one op, not the ten below, in every step of a short chat)
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
