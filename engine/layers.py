"""Building blocks of the decoder: norms, rotary embedding, activations (the Linear is in
engine/linear.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.kernels = cpu_kernels.serves_here()  # the C path's availability, asked once

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), vLLM's fused add. Same
        arithmetic as transformers: the sum rounded to the dtype, normalised in fp32, scaled in the
        weight's dtype."""
        fast = self.kernels and x.is_contiguous() and x.dtype == self.weight.dtype and cpu_kernels.supports(x)
        if residual is not None:
            if fast and residual.is_contiguous() and residual.dtype == x.dtype:
                return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual  # residual updated in place
            residual = x + residual
            return self.forward(residual), residual
        if fast:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)  # one call instead of eight ops
        if self.kernels and x.dim() == 3 and cpu_kernels.heads_contiguous(x) and x.dtype == self.weight.dtype \
                and cpu_kernels.supports(x):  # each head of a view of a qkv output: the q and k norms
            return cpu_kernels.rms_norm_heads(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = cpu_kernels.serves_here()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels and x.is_contiguous() and cpu_kernels.supports(x):
            return cpu_kernels.silu_and_mul(x)  # one call instead of three ops and a temporary
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin cached per position. inv_freq comes
    from transformers' RoPE functions, so every scaling type a config declares is honoured."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        """layer_type: which of the config's per-layer-type RoPE settings (Gemma 3's local and global
        layers); None where the config has one setting for all."""
        super().__init__()
        inv_freq, attention_scaling = _rope_inv_freq(hf_config, head_dim, layer_type)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Plain attributes, not buffers: they stay fp32 when the model is cast to bf16.
        self.cos = freqs.cos() * attention_scaling
        self.sin = freqs.sin() * attention_scaling
        self._looked_up: tuple = (None, None, None)  # (positions, cos, sin) of the forward in progress
        self.kernels = cpu_kernels.serves_here()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated; on the CPU kernel's path in place (one C call)."""
        if self.kernels and q.shape[2] <= 512 and cpu_kernels.heads_contiguous(q) and cpu_kernels.heads_contiguous(k) \
                and q.dtype == k.dtype and cpu_kernels.supports(q):
            cpu_kernels.rotary_neox(q, k, self.cos, self.sin, positions)
            return q, k
        seen, cos, sin = self._looked_up
        if positions is not seen or cos.dtype != q.dtype:  # every layer shares one module: look up once per forward
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            self._looked_up = (positions, cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        by_type = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **by_type)
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0


class GeluAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up with gelu's tanh approximation (`gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, which scales by (1 + weight): the checkpoint's weight is stored plus one at
    load, so the forward (and its C kernel) stay RMSNorm's."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight.weight_loader = _plus_one


def _plus_one(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    with torch.no_grad():
        param.copy_(tensor.float() + 1)
