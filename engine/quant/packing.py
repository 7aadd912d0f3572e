"""The packed layouts our quantized matmul kernels read (engine/csrc/quant_matmul.c, quant_int8_rows.h,
quant_amx.h, quant_matmul_f32.c), built once at load from plain integers and scales: torch only, no C."""
from __future__ import annotations

import torch


def int4_pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
              int8_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, scales and zeros [G, N] (w = (q - 8) * scale + zero) -> the layouts of the
    `dtype` kernel (see the csrc files): bfloat16 (packed [N/16, K/4, 32] uint8, scales and zeros
    [N/16, G, 2, 16] bf16); float32 (packed [N/16, K, 8] uint8, with `int8_rows` [N/16, K/4, 32] as
    csrc/quant_int8_rows_f32.c reads it; scales and shifts = zero - 8 scale [N/16, G, 2, 16] fp32)."""
    N, K = q.shape
    q = q.to(torch.uint8)
    if dtype == torch.float32 and int8_rows:
        quads = q.reshape(N // 16, 2, 8, K // 4, 4)[..., [0, 2, 1, 3]]  # [block, half, column, quad, k]
        packed = (quads[:, 0] | (quads[:, 1] << 4)).permute(0, 2, 1, 3).reshape(N // 16, K // 4, 32).contiguous()
    elif dtype == torch.float32:
        halves = q.reshape(N // 16, 2, 8, K)  # [block, half, column, k]
        packed = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous()
    else:
        quads = q.reshape(N // 16, 16, K // 4, 2, 2)  # [block, column, quad, half, pair]
        packed = (quads[..., 0, :] | (quads[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    if dtype == torch.float32:
        return packed, group_scales(scales.float(), zeros.float() - 8 * scales.float())
    return packed, group_scales(scales.to(torch.bfloat16), zeros.to(torch.bfloat16))


def int5_pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..31 -> [N/16, K/4 * 40] uint8: per block of 16 columns its quads' low nibbles as
    int4_pack lays them (32 bytes each), then each quad's 64 high bits, bit t for byte t of the widened
    quad (csrc/quant_int8_rows.h)."""
    N, K = q.shape
    q = q.to(torch.uint8)
    low, _ = int4_pack(q & 15, torch.ones(1, N), torch.zeros(1, N), torch.bfloat16)
    high = (q >> 4).reshape(N // 16, 16, K // 4, 4)[..., [0, 2, 1, 3]].permute(0, 2, 1, 3).reshape(N // 16, K // 4, 8, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    masks = (high * weights).sum(-1, dtype=torch.uint8)
    return torch.cat([low.reshape(N // 16, -1), masks.reshape(N // 16, -1)], dim=-1).contiguous()


def group_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Per-group scales and zeros [G, N] -> the kernels' [N/16, G, 2, 16] (per block and group, 16
    scales then 16 zeros), in their dtype."""
    G, N = scales.shape
    per_block = [t.reshape(G, N // 16, 16).transpose(0, 1) for t in (scales, zeros)]
    return torch.stack(per_block, dim=2).contiguous()


def int8_pack(q: torch.Tensor, dtype: torch.dtype, int8_rows: bool = False) -> torch.Tensor:
    """q [N, K] int8 -> the `dtype` kernel's packed layout: bfloat16 [N/16, K/2, 32], or for int8 rows
    [N/16, K/4, 64] uint8 (q + 128, each quad's k in the order 0, 2, 1, 3), float32 [N/16, K, 16]
    (see the csrc files)."""
    N, K = q.shape
    if int8_rows:
        quads = (q.to(torch.int16) + 128).to(torch.uint8).reshape(N // 16, 16, K // 4, 4)[..., [0, 2, 1, 3]]
        return quads.permute(0, 2, 1, 3).reshape(N // 16, K // 4, 64)
    if dtype == torch.float32:
        return q.reshape(N // 16, 16, K).transpose(1, 2).contiguous()
    return q.reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()
