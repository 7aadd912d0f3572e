"""GGUF's blocks of more than 4 bits, kept in their integers: Q8_0 and Q6_K as int8 groups, Q5_0 /
Q5_1 / Q5_K in 5 bits. Our kernels only (csrc/quant_int8_rows.h, AVX-512 VNNI, rows rounded to int8);
elsewhere such layers are dense (engine/quant/methods.py asks `runs_here`)."""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.quant import cpu_matmul, packing
from engine.linear import DenseKernel
from engine.quant.kernels import INT8_ROWS_ALL_ROWS_AMX, INT8_ROWS_SMALL_M, QuantizedWeight, _as


class Int8GroupWeight(QuantizedWeight):
    """w[n, k] = q[n, k] * scale[g, n] + zero[g, n], g = k // group (32, or 16 for Q6_K), q int8:
    GGUF's Q8_0, 5-bit and 6-bit blocks kept 8-bit. Our kernel only (csrc/quant_int8_rows.h's tile8g_i8: bf16 rows rounded to int8 per 32
    inputs, AVX-512 VNNI); `runs_here` says whether it can, else the weight is dense. As Int4Weight
    with int8 rows, it takes every row and keeps no dense copy unless `prompt_copy`."""
    bits = 8
    int8_rows = True

    offset = 0  # the packed integers' w = (q - offset) * scale + zero

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                 group: int = 32, prompt_copy: bool = False) -> None:
        self.N, self.K, self.dtype, self.group_size = *q.shape, dtype, group
        self.packed = self._pack(q)
        self.scales_and_zeros = packing.group_scales(scales.to(torch.bfloat16), zeros.to(torch.bfloat16))
        self.small_m = INT8_ROWS_SMALL_M
        self.all_rows = INT8_ROWS_ALL_ROWS_AMX
        g = torch.arange(self.K) // group
        self.dense = DenseKernel(((q.float() - self.offset) * scales.float()[g].T + zeros.float()[g].T).to(dtype)) \
            if prompt_copy else None

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return packing.int8_pack(q.to(torch.int8), torch.bfloat16, int8_rows=True)

    @staticmethod
    def runs_here(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> bool:
        N, K = shape
        return (device.type == "cpu" and cpu_matmul.quant_kernel_dtype(dtype) == torch.bfloat16
                and cpu_kernels.has("quant_bf16") and N % 16 == 0 and K % 32 == 0)

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_matmul.group_matmul(_as(x, torch.bfloat16), self.packed, self.scales_and_zeros, self.group_size,
                                        self.bits, self.amx(x)).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_and_zeros.numel() * 2


class Int5Weight(Int8GroupWeight):
    """w[n, k] = (q[n, k] - 16) * scale[g, n] + zero[g, n], q in 0..31, groups of 32: GGUF's Q5_0,
    Q5_1 and Q5_K blocks in 5 bits (0.75 bytes a weight with the scales, int8 would take 1.125). Takes
    `q` as Packed8 holds it (w = q * scale + zero, q in -16..15 or 0..31). Our kernel only
    (csrc/quant_int8_rows.h's tile4_i8 with BITS 5), rows rounded to int8 as Int8GroupWeight's."""
    bits, offset = 5, 16

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                 group: int = 32, prompt_copy: bool = False) -> None:
        lift = 16 if int(q.min()) < 0 else 0  # to 0..31
        if group != 32 or int(q.max()) + lift > 31 or int(q.min()) + lift < 0:
            raise ValueError("5-bit weights need groups of 32 and integers spanning at most 32 values")
        # w = q * scale + zero == (q5 - 16) * scale + zero', q5 = q + lift
        super().__init__(q.to(torch.int32) + lift, scales, zeros + (16 - lift) * scales, dtype, group, prompt_copy)

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return packing.int5_pack(q)
