"""Which layers get which quantized weight: on-the-fly int8 / int4, or a checkpoint's packed 4-bit layers."""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.checkpoint.load import build_model, quant_spec
from engine.checkpoint.source import ModelSource
from engine.layers import Linear
from engine.quant.choices import CHECKPOINT_FORMATS, choose_mode
from engine.quant.kernels import ConcatWeight, Int4Weight, Int8Weight, quantize_int4, quantize_int8

log = logging.getLogger("pagedchat.quant")


def load_model(source: ModelSource, hf_config, requested: str | None, dtype: torch.dtype, device: torch.device,
               max_model_len: int) -> tuple[nn.Module, str]:
    """The model with its weights in their final form, and the quantization chosen for it."""
    spec = quant_spec(source, hf_config)
    quantization = choose_mode(requested, spec, source.kind, dtype)
    packs = quantization in ("gguf", getattr(spec, "method", None))  # 4-bit layers stay 4-bit
    model, packed = build_model(source, hf_config, dtype, device, max_model_len, keep_packed=packs)
    if "dequantized" in quantization:
        log.info("%s checkpoint dequantized to %s at load (no packed kernel takes that dtype here)", spec.method, dtype)
    else:
        quantize_model(model, quantization, dtype, packed)
    return model, quantization


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype, packed: dict | None = None) -> dict:
    """Swap each Linear's matmul (and the LM head's) for a quantized one. `mode` "gguf" and
    checkpoint formats take their layers from `packed` (Packed4 shards per Linear). Returns a
    summary of the path chosen per kind of layer, logged once."""
    checkpoint, packed = mode in CHECKPOINT_FORMATS, packed or {}
    if mode == "none":
        return {}
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        if mode == "gguf" or checkpoint:
            module.quant = _from_packed(packed.get(name), dtype, module.weight.device)
        else:
            module.quant = _on_the_fly(module.weight.data, mode, dtype)
        if module.quant is not None:
            module.weight = None  # the quantized weight keeps what it needs (a dense copy on CPU)
        kind = name.rsplit(".", 1)[-1]
        chosen[kind] = type(module.quant).__name__ if module.quant is not None else "bf16 dense"
    if checkpoint:  # the checkpoint decides: its LM head stays as it was stored
        return chosen
    head = model.lm_head.weight.data if model.lm_head is not None else model.model.embed_tokens.weight.data
    # The LM head is the largest matmul of a small model's decode step: quantize it even when the
    # embedding it is tied to stays a plain lookup table.
    model.lm_head_quant = _on_the_fly(head, "int8" if mode == "gguf" else mode, dtype)
    if model.lm_head is not None:
        model.lm_head.quant, model.lm_head.weight = model.lm_head_quant, None
    chosen["lm_head"] = type(model.lm_head_quant).__name__
    for kind, path in sorted(chosen.items()):
        log.info("quantization %s: %s -> %s", mode, kind, path)
    return chosen


def _on_the_fly(w: torch.Tensor, mode: str, dtype: torch.dtype):
    if mode == "int8":
        q, scales = quantize_int8(w)
        return Int8Weight(q, scales, dtype)
    group = 64 if mode == "int4-g64" else 32
    if w.shape[1] % group or w.shape[0] % 16:
        return None
    q, scales, zeros = quantize_int4(w, group)
    return Int4Weight(q, scales, zeros, group, dtype)


def _from_packed(parts: list | None, dtype: torch.dtype, device: torch.device):
    """Packed 4-bit shards of one Linear (a fused one has several): one Int4Weight when they share
    the input order and group size, else one each, their outputs concatenated."""
    if not parts:
        return None
    perms = {None if p.perm is None else tuple(p.perm.tolist()) for p in parts}
    if len(perms) == 1 and len({p.group for p in parts}) == 1:
        q, s, z = (torch.cat([getattr(p, f) for p in parts], dim) for f, dim in (("q", 0), ("scales", 1), ("zeros", 1)))
        return Int4Weight(q.to(device), s.to(device), z.to(device), parts[0].group, dtype, perm=_to(parts[0].perm, device))
    return ConcatWeight([Int4Weight(p.q.to(device), p.scales.to(device), p.zeros.to(device), p.group, dtype,
                                    perm=_to(p.perm, device)) for p in parts])


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
