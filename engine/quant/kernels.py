"""Quantized weights in their kernels' layouts, converted once at load.

CPU: a packed kernel serves decode-sized batches: ours (engine/csrc/quant_matmul.c for bf16 rows where
the CPU has AVX-512 BF16 and VNNI, engine/csrc/quant_matmul_f32.c for fp32 rows where it has AVX2; by
default the rows are rounded to int8 (`int8_rows`: quant_int8_rows.h, quant_int8_rows_f32.c)), else PyTorch's
`_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`. They lose to a dense matmul (engine/linear.py)
on many rows, so each weight also keeps a dense copy in the model dtype (prompt rows take it) and
`packed_rows` picks the path per call; weights with int8 rows (4-bit, GGUF's 5-, 6- and 8-bit blocks, the
LM head) take every row and keep none, unless the engine's dense_prompt_weights asks for one on a CPU
with AMX, where large steps' prompt rows then take it. Where the CPU has AMX-INT8, int8 rows run their
whole 16-row tiles on AMX from `amx_from` rows (bit-identical; measured at load, engine/quant/choose.py).
CUDA: `torch._weight_int4pack_mm` for every row count, no dense copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.quant import cpu_matmul, packing
from engine.attention import decode_rows
from engine.checkpoint.quantized import INT4_GROUP_SIZES
from engine.linear import DenseKernel, Linear, LinearKernel

# Rows up to which the packed kernels beat dense bf16 in a decode step on this CPU. Measured in the
# engine, not on one matrix: a lone matrix sits in cache and favours dense already at 2 rows, but a
# step streams every weight from memory, and bf16 is 4x the bytes (SMALL_M = 1: batch-2 steps 20 -> 35 ms).
SMALL_M = 4
# The same for our kernels, by activation dtype, measured as decode steps of the default model
# (median ms, ours vs dense for the 4-bit layers). bf16 (engine/csrc/quant_matmul.c, AVX-512 BF16, two
# warm threads): 24 rows 40 vs 53, 32 rows 50 vs 61, 48 rows 67 vs 76, 64 rows 87 vs 92; 8-bit (the
# 49152x576 LM head) 2.6 against 2.7 ms at 8 rows, slower at 16 (its widening through fp32 costs more per
# weight than the nibbles' OR). fp32 (engine/csrc/quant_matmul_f32.c, AVX2, an AMD EPYC without
# AVX-512): 8 rows 36 vs 93, 32 rows 113 vs 196, 64 rows 203 vs 266, 128 rows 233 vs 300; its LM head
# 39 vs 53 at 8 rows, 184 vs 202 at 64 (fp32 dense weights are 4 bytes each: streaming them costs more
# than widening). With int8 rows (the default) the fp32 4-bit layers keep no dense copy and take every row.
OUR_SMALL_M = {(4, torch.bfloat16): 64, (8, torch.bfloat16): 8, (4, torch.float32): 128, (8, torch.float32): 64}
# 8-bit weights with int8 rows (the LM head, 49152x576, ms, int8 rows vs bf16 rows vs dense): 1 row 0.94 vs
# 1.16 vs 3.31, 8 rows 2.30 vs 2.67 vs 3.85, 32 rows 6.4 vs 8.6 vs 7.0, 64 rows 11.4 vs 16.5 vs 18.2. fp32 rows
# on AVX2 (an AMD EPYC, Zen 3, 2026-12-06, ms, int8 rows vs the FMA kernel): 1 row 1.0 vs 2.1, 8 rows 6.2 vs 6.9,
# 64 rows 37 vs 35.
INT8_ROWS_SMALL_M = 64
# 4-bit weights with int8 rows take every row of every step, prompts' too, and keep no dense copy:
# each row is rounded alone, so a row computes the same in any step, and without matrix units the
# integer dot products win at every size. Measured on a Xeon with AVX-512 VNNI and no AMX (2026-12-02,
# ms, int8 rows vs dense bf16, 2 threads): 3072x576 64 rows 0.73 vs 1.79, 256 3.0 vs 8.5, 1024 13.5 vs
# 26.5; 576x1536 1024 rows 9.2 vs 16.2; a 1024-token prompt step 2156 -> 1252 ms. On an AMD EPYC (AVX-512,
# no AMX, 2026-12-01; one layer's four matmuls) 64 rows 1.87 vs 4.16, 256 6.6 vs 9.2, 512 14.2 vs 12.8,
# 1024 33 vs 27. Where the CPU has AMX and dense_prompt_weights asks for it, oneDNN's bf16 tiles take the
# prompt rows of steps above INT8_ROWS_ALL_ROWS_AMX rows, from a dense copy: on a Xeon with AMX (2026-12-04)
# a 1500-token prompt of the default model as Q4_K_M took 1.34 s with it against 1.94 s, for 310 MiB of
# weights against 108.
INT8_ROWS_ALL_ROWS_AMX = 384


def packed_rows(rows: int, limit: int, all_rows: int = 0) -> int:
    """How many leading rows take the packed kernel (the rest the dense copy). In a model step: all
    of them when there are at most `all_rows` (int8 rows), else its decode rows when there are at
    most `limit`, never a prompt's rows, so a decode computes the same whatever prompts share its
    step. Elsewhere (the LM head, scoring): all rows when there are at most `limit`."""
    decodes = decode_rows()
    if decodes is None:
        return rows if rows <= limit else 0
    if rows <= all_rows:
        return rows
    return decodes if decodes <= limit else 0


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype is dtype else x.to(dtype)


class QuantizedWeight(LinearKernel):
    """The kernel of a quantized Linear: y = x @ W^T without materialising W for small batches."""
    bits: int
    dense: DenseKernel | None
    small_m: int  # rows up to which the packed kernel serves (packed_rows)
    int8_rows = False  # bf16 rows rounded to int8 per 32 inputs (csrc/quant_matmul.c's *_i8 kernels)
    all_rows = 0  # packed_rows'
    amx_from = 0  # int8 rows: calls with at least this many rows run their 16-row tiles on AMX (0: never;
    # engine/quant/choose.py measures it at load; the results are the same either way)
    tiles_from = 0  # 4-bit: calls with at least this many rows take AMX bf16 tiles (0: never; the engine's
    # batch_invariant off, measured at load: these rows then compute apart from the int8-row kernels')

    @property
    def label(self) -> str:
        return type(self).__name__

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.matmul(x)
        return y if bias is None else y + bias

    @property
    def resident_bytes(self) -> int:
        return self.nbytes + (self.dense.resident_bytes if self.dense is not None else 0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < self.tiles_from <= x.shape[0]:
            return self._tiles_matmul(x)
        if self.dense is None:  # every row (120 calls a step: no slicing on this path)
            return self._packed_matmul(x)
        small = packed_rows(x.shape[0], self.small_m, self.all_rows)
        if small == 0:
            return self.dense(x)
        y = self._packed_matmul(x[:small])
        return y if small == x.shape[0] else torch.cat([y, self.dense(x[small:])])

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _tiles_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def amx(self, x: torch.Tensor) -> bool:
        return 0 < self.amx_from <= x.shape[0]

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class Int4Weight(QuantizedWeight):
    """w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size; q in 0..15.
    `perm` (act-order checkpoints) reorders the input features so groups are contiguous.
    Where our kernels run (AVX-512 BF16 for bf16 rows, AVX2 for fp32 ones), few rows go through them,
    else through torch's. `int8_rows`: the rows are rounded to int8 per 32 inputs (the engine's
    int8_activations); then our kernel takes every row of every step and keeps no dense copy, unless
    `prompt_copy` (the engine's dense_prompt_weights, on a CPU with AMX)."""
    bits = 4

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 dtype: torch.dtype, perm: torch.Tensor | None = None, keep_dense: bool = True,
                 int8_rows: bool = True, prompt_copy: bool = False) -> None:
        N, K = q.shape
        if group_size not in INT4_GROUP_SIZES or K % group_size or N % 16:
            raise ValueError(f"int4 kernel needs group size in {INT4_GROUP_SIZES}, K % group == 0, N % 16 == 0; "
                             f"got N={N}, K={K}, group {group_size}")
        self.N, self.K, self.group_size, self.dtype, self.perm = N, K, group_size, dtype, perm
        device = q.device
        self.kernel_dtype = cpu_matmul.quant_kernel_dtype(dtype) if device.type == "cpu" else None
        self.int8_rows = self.kernel_dtype is not None and int8_rows
        if self.kernel_dtype is not None:
            self.packed, self.scales_and_zeros = packing.int4_pack(q, scales, zeros, self.kernel_dtype, self.int8_rows)
        else:
            self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
            if device.type == "cuda":
                self.packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
            else:
                self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.small_m = OUR_SMALL_M[4, self.kernel_dtype] if self.kernel_dtype is not None else SMALL_M
        every_row = self.int8_rows and not prompt_copy
        self.all_rows = INT8_ROWS_ALL_ROWS_AMX if self.int8_rows else 0
        self.dense = DenseKernel(self.dequantize(q, scales, zeros).to(dtype)) \
            if keep_dense and device.type == "cpu" and not every_row else None

    def dequantize(self, q, scales, zeros) -> torch.Tensor:
        g = torch.arange(self.K, device=q.device) // self.group_size
        w = (q.float() - 8) * scales.float()[g].T + zeros.float()[g].T
        if self.perm is not None:  # back to the checkpoint's input order
            w = w[:, torch.argsort(self.perm)]
        return w

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if self.perm is None else x[:, self.perm]
        if self.kernel_dtype is not None:
            y = cpu_matmul.int4_matmul(_as(xb, self.kernel_dtype), self.packed, self.scales_and_zeros, self.group_size,
                                        self.int8_rows, self.amx(x))
        elif xb.device.type == "cuda":
            y = torch._weight_int4pack_mm(xb.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xb.to(torch.bfloat16).contiguous(), self.packed, self.group_size,
                                                  self.scales_and_zeros)
        return y if y.dtype is x.dtype else y.to(x.dtype)

    def _tiles_matmul(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if self.perm is None else x[:, self.perm]
        return cpu_matmul.int4_matmul_bf16_tiles(_as(xb, torch.bfloat16), self.packed, self.scales_and_zeros,
                                                  self.group_size).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


class Int8Weight(QuantizedWeight):
    """w[n, k] = q[n, k] * scale[n]: int8 per output channel. Few rows go through our kernels where
    they run (Int4Weight's), else through torch's; with int8 rows up to INT8_ROWS_SMALL_M."""
    bits = 8

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, keep_dense: bool = True,
                 int8_rows: bool = True) -> None:
        self.q = q.to(torch.int8).contiguous()
        self.dtype, (self.N, self.K) = dtype, q.shape
        fits = q.device.type == "cpu" and q.shape[0] % 16 == 0 and q.shape[1] % 2 == 0
        self.kernel_dtype = cpu_matmul.quant_kernel_dtype(dtype) if fits else None
        self.int8_rows = self.kernel_dtype is not None and int8_rows and q.shape[1] % 32 == 0
        if self.kernel_dtype is not None:
            self.q = packing.int8_pack(self.q, self.kernel_dtype, self.int8_rows)
            self.scales = scales.float().contiguous()
        else:
            self.scales = scales.to(torch.bfloat16).contiguous()
        self.small_m = INT8_ROWS_SMALL_M if self.int8_rows else \
            OUR_SMALL_M[8, self.kernel_dtype] if self.kernel_dtype is not None else SMALL_M
        self.dense = DenseKernel((q.float() * scales.float()[:, None]).to(dtype)) \
            if keep_dense and q.device.type == "cpu" else None

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_dtype is not None:
            y = cpu_matmul.int8_matmul(_as(x, self.kernel_dtype), self.q, self.scales, self.int8_rows, self.amx(x))
            return y if y.dtype is x.dtype else y.to(x.dtype)
        if x.device.type == "cpu":
            return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scales).to(x.dtype)
        return F.linear(x, (self.q.to(x.dtype) * self.scales.to(x.dtype)[:, None]))

    def rows(self, n: torch.Tensor) -> torch.Tensor:
        """Rows n of W (fp32, [len(n), K]), read from whichever layout the kernel keeps: what lets a
        tied LM head's weight serve the embedding lookup too (PackedEmbedding)."""
        N, K = self.N, self.K
        if self.q.dim() == 2:  # torch's kernels: plain [N, K]
            q = self.q[n].float()
        elif self.int8_rows:  # [N/16, K/4, 64]: q + 128, each quad's k in the order 0, 2, 1, 3 (its own inverse)
            quads = self.q.view(N // 16, K // 4, 16, 4)[n // 16, :, n % 16][..., [0, 2, 1, 3]]
            q = quads.reshape(-1, K).float() - 128
        elif self.kernel_dtype == torch.float32:  # [N/16, K, 16]
            q = self.q[n // 16, :, n % 16].float()
        else:  # bf16 rows: [N/16, K/2, 32], byte 2c + i of pair p is q[16b + c, 2p + i]
            q = self.q.view(N // 16, K // 2, 16, 2)[n // 16, :, n % 16].reshape(-1, K).float()
        return q * self.scales[n].float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


class PackedEmbedding(nn.Module):
    """The embedding lookup of a model whose LM head is tied to it and quantized: the head's weight
    holds the table once (the rows are dequantized per token; a step looks up at most a few thousand),
    instead of a second copy in the model dtype (54 MiB of SmolLM2's 135M weights)."""

    def __init__(self, kernel: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel, self.dtype = kernel, dtype
        # int8 rows: our C lookup (the same bits; the torch path took 264 us of a one-session step)
        self.lookup = cpu_kernels.serves_here() and kernel.int8_rows and kernel.q.dim() == 3 \
            and dtype in (torch.float32, torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.lookup and flat.dtype == torch.int64 and flat.is_contiguous():
            rows = cpu_kernels.int8_rows_lookup(self.kernel.q, self.kernel.scales, flat, self.dtype)
        else:
            rows = self.kernel.rows(flat).to(self.dtype)
        return rows.view(*ids.shape, -1)


class ConcatWeight(QuantizedWeight):
    """A fused Linear whose shards cannot share one packed matrix (different act-order)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.dense = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.resident_bytes for p in self.parts)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit per group of inputs -> (q [N, K], scales [G, N], zeros [G, N])
    in the kernel's convention w ~ (q - 8) * scale + zero."""
    N, K = w.shape
    groups = w.float().reshape(N, K // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
    return q, scale.T.contiguous(), (lo + 8 * scale).T.contiguous()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel -> (q [N, K], scales [N])."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_rows_in_use(model) -> bool:
    """Whether decode rows of this model meet its packed weights as int8 (`int8_rows`)."""
    return any(getattr(m.kernel, "int8_rows", False) for m in model.modules() if isinstance(m, Linear))
