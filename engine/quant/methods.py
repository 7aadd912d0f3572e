"""Which layers get which quantized weight: on-the-fly int8 / int4, or GGUF's packed blocks."""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.layers import Linear
from engine.quant.kernels import ConcatWeight, Int4Weight, Int8Weight, quantize_int4, quantize_int8

log = logging.getLogger("pagedchat.quant")

QUANTIZATION_MODES = ("none", "int8", "int4", "int4-g64", "gguf")


def valid_modes(source_kind: str, dtype: torch.dtype) -> list[str]:
    """Modes that apply to a model: the packed kernels take bf16 activations."""
    modes = ["none"]
    if dtype == torch.bfloat16:
        modes += ["int8", "int4", "int4-g64"] + (["gguf"] if source_kind == "gguf" else [])
    return modes


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype, gguf_blocks: dict | None = None) -> dict:
    """Swap each Linear's matmul (and the LM head's) for a quantized one. Returns a summary of the
    path chosen per kind of layer, logged once."""
    if mode == "none":
        return {}
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        if mode in ("gguf", "checkpoint"):
            module.quant = _from_blocks(name, gguf_blocks or {}, dtype)
        else:
            module.quant = _on_the_fly(module.weight.data, mode, dtype)
        if module.quant is not None:
            module.weight = None  # the quantized weight keeps what it needs (a dense copy on CPU)
        kind = name.rsplit(".", 1)[-1]
        chosen[kind] = type(module.quant).__name__ if module.quant is not None else "bf16 dense"
    if mode == "checkpoint":  # the checkpoint decides: its LM head stays as it was stored
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


def _from_blocks(name: str, blocks: dict, dtype: torch.dtype):
    """Packed 4-bit shards of one Linear (a fused one has several): one Int4Weight when they share
    the input order and group size, else one each, their outputs concatenated."""
    parts = blocks.get(name)
    if not parts or any(p is None for p in parts):
        return None
    parts = [p if len(p) == 5 else (*p, None, 32) for p in parts]  # GGUF shards: no perm, groups of 32
    perms, groups = {None if p[3] is None else tuple(p[3].tolist()) for p in parts}, {p[4] for p in parts}
    if len(perms) == 1 and len(groups) == 1:
        q, s, z = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts], 1)
        return Int4Weight(q, s, z, parts[0][4], dtype, perm=parts[0][3])
    return ConcatWeight([Int4Weight(p[0], p[1], p[2], p[4], dtype, perm=p[3]) for p in parts])
