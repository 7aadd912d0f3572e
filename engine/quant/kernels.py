"""Quantized weights in PyTorch's own weight-only kernel layouts, converted once at load.

CPU: `torch._weight_int4pack_mm_for_cpu` / `torch._weight_int8pack_mm` win for decode-sized
batches (few rows) and lose to a dense bf16 matmul (engine/dense.py) from about 8 rows up, so
each weight also keeps a dense bf16 copy and the path is chosen per call by row count (SMALL_M,
measured here). The dense copy costs the bf16 weight's memory on top of the packed one (+2 bytes
per weight).
CUDA: `torch._weight_int4pack_mm` for every row count, no dense copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.dense import DenseWeight

# Rows up to which the packed kernels beat dense bf16 in a decode step on this CPU. Measured in the
# engine, not on one matrix: a lone matrix sits in cache and favours dense already at 2 rows, but a
# step streams every weight from memory, and bf16 is 4x the bytes (SMALL_M = 1: batch-2 steps 20 -> 35 ms).
SMALL_M = 4
INT4_GROUP_SIZES = (32, 64, 128, 256)


class QuantizedWeight:
    """The matmul a quantized Linear runs: y = x @ W^T without materialising W for small batches."""
    bits: int
    dense: DenseWeight | None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class Int4Weight(QuantizedWeight):
    """w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size; q in 0..15.
    `perm` (act-order checkpoints) reorders the input features so groups are contiguous."""
    bits = 4

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 dtype: torch.dtype, perm: torch.Tensor | None = None, keep_dense: bool = True) -> None:
        N, K = q.shape
        if group_size not in INT4_GROUP_SIZES or K % group_size or N % 16:
            raise ValueError(f"int4 kernel needs group size in {INT4_GROUP_SIZES}, K % group == 0, N % 16 == 0; "
                             f"got N={N}, K={K}, group {group_size}")
        self.N, self.K, self.group_size, self.dtype, self.perm = N, K, group_size, dtype, perm
        device = q.device
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
        if device.type == "cuda":
            packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
            self.packed = torch._convert_weight_to_int4pack(packed, 8)
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.dense = DenseWeight(self.dequantize(q, scales, zeros).to(dtype)) \
            if keep_dense and device.type == "cpu" else None

    def dequantize(self, q, scales, zeros) -> torch.Tensor:
        g = torch.arange(self.K, device=q.device) // self.group_size
        w = (q.float() - 8) * scales.float()[g].T + zeros.float()[g].T
        if self.perm is not None:  # back to the checkpoint's input order
            w = w[:, torch.argsort(self.perm)]
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > SMALL_M:
            return self.dense(x)
        xb = x.to(torch.bfloat16)
        if self.perm is not None:
            xb = xb[:, self.perm]
        if xb.device.type == "cuda":
            y = torch._weight_int4pack_mm(xb, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


class Int8Weight(QuantizedWeight):
    """w[n, k] = q[n, k] * scale[n]: int8 per output channel."""
    bits = 8

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, keep_dense: bool = True) -> None:
        self.q = q.to(torch.int8).contiguous()
        self.scales = scales.to(torch.bfloat16).contiguous()
        self.dtype = dtype
        self.dense = DenseWeight((self.q.float() * scales.float()[:, None]).to(dtype)) \
            if keep_dense and q.device.type == "cpu" else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > SMALL_M:
            return self.dense(x)
        if x.device.type == "cpu":
            return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scales).to(x.dtype)
        return F.linear(x, (self.q.to(x.dtype) * self.scales.to(x.dtype)[:, None]))

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2


class ConcatWeight(QuantizedWeight):
    """A fused Linear whose shards cannot share one packed matrix (different act-order)."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.dense = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes + (p.dense.nbytes if p.dense is not None else 0) for p in self.parts)


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


def weight_bytes(model) -> int:
    """Bytes the weights take: parameters plus packed weights and their dense copies."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    seen = set()
    for module in model.modules():
        for q in (getattr(module, "quant", None), getattr(module, "lm_head_quant", None)):
            if q is not None and id(q) not in seen:
                seen.add(id(q))
                total += q.nbytes + (q.dense.nbytes if q.dense is not None else 0)
        for d in (getattr(module, "dense", None), getattr(module, "lm_head_dense", None)):
            if d is not None:  # packed copies (engine/dense.py): not parameters
                total += d.nbytes
    return total
