"""4-bit checkpoint formats (GPTQ, AWQ GEMM, compressed-tensors pack-quantized; GGUF Q4 blocks in
gguf.py) read into one shape, Packed4, in the int4 kernel's convention w = (q - 8) * scale + zero.
Layouts: docs/ARCHITECTURE.md ("Quantized checkpoints"). Variants we cannot run are refused by name."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes the int4 kernels take
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


@dataclass
class Packed4:
    """One Linear's 4-bit weight: q [N, K] in 0..15, scales and zeros [G, N] (fp32), perm [K] (the
    input order of act-order checkpoints) or None, group size."""
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    group: int
    bits = 4

    def dequantize(self) -> torch.Tensor:
        g = torch.arange(self.q.shape[1]) // self.group
        w = (self.q.float() - 8) * self.scales[g].T + self.zeros[g].T
        return w if self.perm is None else w[:, torch.argsort(self.perm)]


@dataclass
class Packed8:
    """One Linear's weight of up to 8 bits in groups of 32 (GGUF's Q8_0 and 5-bit blocks) or 16 (Q6_K):
    q [N, K] int8, scales and zeros [G, N] fp32, w = q * scale + zero. `bits` 5: q spans at most 32
    values (-16..15 or 0..31), which the 5-bit kernel keeps in 5 bits."""
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int = 32
    bits: int = 8
    perm = None

    def dequantize(self) -> torch.Tensor:
        g = torch.arange(self.q.shape[1]) // self.group
        return self.q.float() * self.scales[g].T + self.zeros[g].T


@dataclass
class QuantSpec:
    method: str  # "gptq" | "awq" | "compressed-tensors"
    group_size: int  # -1: one group over all inputs
    sym: bool = True
    v1_zeros: bool = True  # GPTQ "gptq" format stores zero - 1
    ignore: list[str] = field(default_factory=list)

    @property
    def parts(self) -> tuple[str, ...]:
        return CT_PARTS if self.method == "compressed-tensors" else GPTQ_PARTS


def detect(folder: str, hf_config) -> QuantSpec | None:
    """From config.json's quantization_config, else quantize_config.json, else quant_config.json."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        for name in ("quantize_config.json", "quant_config.json"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path) as f:
                    qc = json.load(f)
                qc.setdefault("quant_method", "awq" if "w_bit" in qc else "gptq")
                break
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "gptq":
        _require(qc.get("bits", 4) == 4, f"GPTQ with {qc.get('bits')} bits")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        _require(fmt in ("gptq", "gptq_v2"), f"GPTQ checkpoint format {fmt!r} (marlin, exllama, bitblas...)")
        return QuantSpec("gptq", int(qc.get("group_size", 128)), bool(qc.get("sym", True)), fmt == "gptq")
    if method == "awq":
        _require(qc.get("bits", qc.get("w_bit", 4)) == 4, "AWQ with other than 4 bits")
        version = str(qc.get("version", "gemm")).lower()
        _require(version == "gemm", f"AWQ version {version!r} (only the GEMM layout is supported)")
        _require(qc.get("zero_point", True), "AWQ without zero point")
        return QuantSpec("awq", int(qc.get("group_size", qc.get("q_group_size", 128))), False, False)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        _require(fmt == "pack-quantized", f"compressed-tensors format {fmt!r} (only pack-quantized)")
        groups = list(qc.get("config_groups", {}).values())
        _require(len(groups) == 1, "compressed-tensors with several config groups")
        w = groups[0].get("weights") or {}
        _require(w.get("num_bits") == 4 and w.get("type", "int") == "int", f"compressed-tensors {w.get('num_bits')}-bit "
                 f"{w.get('type')} weights")
        _require(w.get("strategy") in ("group", "channel"), f"compressed-tensors strategy {w.get('strategy')!r}")
        size = int(w.get("group_size") or -1) if w.get("strategy") == "group" else -1
        return QuantSpec("compressed-tensors", size, bool(w.get("symmetric", True)), False, list(qc.get("ignore", [])))
    raise ValueError(f"unsupported quantization method {method!r}: pagedchat reads 4-bit GPTQ, AWQ (GEMM) "
                     f"and compressed-tensors pack-quantized checkpoints")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"unsupported quantized checkpoint: {what}")


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each, least significant first -> [R, 8C] along the last dim."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


def to_int4(spec: QuantSpec, parts: dict[str, torch.Tensor]) -> Packed4:
    """One Linear's checkpoint tensors (qweight, scales, ...) in the kernel's convention."""
    if spec.method == "gptq":
        q = _unpack_rows(parts["qweight"].T.contiguous())  # [N, K]
        scales = parts["scales"].float()
        z = _unpack_rows(parts["qzeros"]).float()[:, :scales.shape[1]] + (1 if spec.v1_zeros else 0)
        g_idx = parts.get("g_idx")
    elif spec.method == "awq":
        inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
        q = _unpack_rows(parts["qweight"]).reshape(parts["qweight"].shape[0], -1, 8)[..., inverse]
        q = q.reshape(parts["qweight"].shape[0], -1).T.contiguous()
        scales = parts["scales"].float()
        z = _unpack_rows(parts["qzeros"]).reshape(scales.shape[0], -1, 8)[..., inverse].reshape(scales.shape[0], -1)
        z = z.float()
        g_idx = None
    else:
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        q = _unpack_rows(parts["weight_packed"])[:, :k]
        scales = parts["weight_scale"].float().T.contiguous()  # [G, N]
        if "weight_zero_point" in parts and not spec.sym:
            z = _unpack_rows(parts["weight_zero_point"].T.contiguous()).float()[:, :n]  # stored + 8
        else:
            z = torch.full_like(scales, 8.0)
        g_idx = parts.get("weight_g_idx")
    N, K = q.shape
    zeros = (8 - z) * scales  # s * (q - z) == (q - 8) * s + (8 - z) * s
    group = spec.group_size if spec.group_size > 0 else K
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // group):
        perm = torch.argsort(g_idx.long(), stable=True)
        q = q[:, perm]
    if group not in INT4_GROUP_SIZES:  # one scale over all K, or groups the kernel lacks: repeat them
        fit = next((g for g in reversed(INT4_GROUP_SIZES) if group % g == 0 and K % g == 0), None)
        if fit is None:
            raise ValueError(f"group size {group} with K={K} fits none of the int4 kernel's groups")
        scales, zeros = scales.repeat_interleave(group // fit, 0), zeros.repeat_interleave(group // fit, 0)
        group = fit
    return Packed4(q.to(torch.int32), scales, zeros, perm, group)
