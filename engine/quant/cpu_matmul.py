"""Our 4-, 5- and 8-bit matmul kernels on the CPU (csrc/quant_matmul*.c, csrc/quant_amx*.h), called through
engine/cpu_kernels.py's library: which activation dtypes they take on this CPU, and one call per packed
layout (engine/quant/packing.py packs for them)."""
from __future__ import annotations

import torch

from engine import cpu_kernels


def quant_matmul_dtypes() -> tuple[torch.dtype, ...]:
    """The activation dtypes our 4-/8-bit kernels take on this CPU: bfloat16 needs AVX-512 BF16
    (csrc/quant_matmul.c), float32 AVX2 with FMA (csrc/quant_matmul_f32.c); empty: torch's kernels."""
    return tuple(dtype for dtype, feature in ((torch.bfloat16, "quant_bf16"), (torch.float32, "quant_f32"))
                 if cpu_kernels.has(feature))


def quant_kernel_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """Which of our kernels serves a model of `dtype`: its own where there is one, else the fp32 one
    (its rows converted), else None (torch's kernels)."""
    dtypes = quant_matmul_dtypes()
    return dtype if dtype in dtypes else torch.float32 if torch.float32 in dtypes else None


def amx_tiles_computed() -> int:
    """How many tiles of 16 rows by 16 columns the int8-row kernels have run on AMX in this process."""
    return cpu_kernels.library().amx_tiles_computed() if cpu_kernels.available() else 0


def _packed_call(fn, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *args) -> torch.Tensor:
    """y [M, N] in x's dtype by fn(x, packed, scales, y, M, K, N, *args), N = 16 * packed.shape[0]."""
    M, K = x.shape
    x = x if x.is_contiguous() else x.contiguous()  # no copy when it is: these run 120 times a step
    y = x.new_empty(M, packed.shape[0] * 16)
    code = fn(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), M, K, y.shape[1], *args)
    if code:
        cpu_kernels.check(code, getattr(fn, "__name__", "a matmul kernel"))
    return y


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                int8_rows: bool = False, amx: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed 4-bit weight^T -> [M, N] in x's dtype, bfloat16 or float32, which picks
    the kernel: pack for it (quant/packing.py's int4_pack, with the same `int8_rows`). `int8_rows`: rows
    rounded to int8 per 32 inputs (K % 32 == 0; bf16 on AVX-512 VNNI, fp32 on AVX2); `amx`: bf16 rows'
    whole tiles of 16 rows on AMX (same results, has("amx_tiles"))."""
    lib, threads = cpu_kernels.library(), cpu_kernels.threads()
    if int8_rows:
        if x.dtype == torch.float32:
            return _packed_call(lib.int4_matmul_f32_i8, x, packed, scales, group_size, threads)
        return _packed_call(lib.int4_matmul_i8, x, packed, scales, group_size, threads, amx)
    fn = lib.int4_matmul_f32 if x.dtype == torch.float32 else lib.int4_matmul
    return _packed_call(fn, x, packed, scales, group_size, threads)


def int4_matmul_bf16_tiles(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [M, K] bf16 @ int4_matmul's packed weight^T on AMX bf16 tiles (has("amx_bf16_tiles")): each block
    of 16 columns widened to bf16 once per call, fp32 sums over all K (csrc/quant_amx_bf16.h)."""
    lib, threads = cpu_kernels.library(), cpu_kernels.threads()
    return _packed_call(lib.int4_matmul_bf16_tiles, x, packed, scales, group_size, threads)


def group_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int, bits: int,
                 amx: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ a weight in groups of `group` inputs^T -> [M, N] bf16, the rows rounded to int8 per
    32 inputs (AVX-512 VNNI); scales and zeros as group_scales in bf16. `bits` 8 (groups of 16 or 32):
    packed as int8_pack(q, int8_rows=True), w = q * scale + zero; 5 (groups of 32): packed as
    int5_pack(q), w = (q - 16) * scale + zero. `amx` as int4_matmul's."""
    lib, threads = cpu_kernels.library(), cpu_kernels.threads()
    fn = lib.int5_matmul_i8 if bits == 5 else lib.int8g_matmul_i8
    return _packed_call(fn, x, packed, scales, group, threads, amx)


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, int8_rows: bool = False,
                amx: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed int8 weight^T * scales (fp32 [N]) -> [M, N] in x's dtype, bfloat16 or
    float32, which picks the kernel: pack for it (int8_pack, with the same `int8_rows`); `amx` as
    int4_matmul's."""
    lib, threads = cpu_kernels.library(), cpu_kernels.threads()
    if int8_rows:
        if x.dtype == torch.float32:
            return _packed_call(lib.int8_matmul_f32_i8, x, packed, scales, threads)
        return _packed_call(lib.int8_matmul_i8, x, packed, scales, threads, amx)
    fn = lib.int8_matmul_f32 if x.dtype == torch.float32 else lib.int8_matmul
    return _packed_call(fn, x, packed, scales, threads)
