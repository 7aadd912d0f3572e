"""Which kernel each Linear runs once the weights are loaded (vLLM's process_weights_after_loading):
on-the-fly int8 / int4, a checkpoint's packed 4-bit layers, or the dense weight, packed where that pays."""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.config import cpu_flags
from engine.linear import DenseKernel, Linear, LinearKernel
from engine.quant.choices import CHECKPOINT_FORMATS
from engine.checkpoint.load import place_dequantized
from engine.checkpoint.quantized import Packed8
from engine.quant.group_kernels import Int5Weight, Int8GroupWeight
from engine.quant.kernels import ConcatWeight, Int4Weight, Int8Weight, PackedEmbedding, quantize_int4, quantize_int8

log = logging.getLogger("pagedchat.quant")


def quantize_linears(model: nn.Module, mode: str, dtype: torch.dtype, packed: dict | None = None,
                     int8_rows: bool = True, dense_prompt_weights: bool = False) -> dict[str, str]:
    """Give each Linear (the LM head too) its quantized kernel. `mode` "gguf" and checkpoint formats
    take their layers from `packed` (Packed4 / Packed8 shards per Linear); a layer no kernel takes
    stays dense. `dense_prompt_weights`: layers with int8 rows also keep a dense copy for large prompt
    steps, where the CPU has AMX. Returns the kernel chosen per kind of layer, logged once."""
    checkpoint, packed = mode in CHECKPOINT_FORMATS, packed or {}
    copy = dense_prompt_weights and "amx_bf16" in cpu_flags()
    if mode == "none" or "dequantized" in mode:
        return {}
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if name == "lm_head":
            if checkpoint:  # the checkpoint decides: its LM head stays as it was stored
                continue
            # The LM head is the largest matmul of a small model's decode step: quantize it even
            # when the embedding it is tied to is not (share_tied_embedding may then serve it).
            kernel = _on_the_fly(module.source_weight.data, "int8" if mode == "gguf" else mode, dtype, int8_rows,
                                 keep_dense=False)
        elif mode == "gguf" or checkpoint:
            kernel = _from_packed(packed.get(name), dtype, module.source_weight.device, int8_rows, copy)
            if kernel is None and packed.get(name):  # no kernel of its kind runs here: dense after all
                place_dequantized(module, packed[name])
        else:
            kernel = _on_the_fly(module.source_weight.data, mode, dtype, int8_rows, prompt_copy=copy)
        if kernel is not None:
            module.set_kernel(kernel)
        chosen[name.rsplit(".", 1)[-1]] = kernel.label if kernel is not None else "bf16 dense"
    for kind, path in sorted(chosen.items()):
        log.info("quantization %s: %s -> %s", mode, kind, path)
    return chosen


def pack_dense_linears(model: nn.Module) -> None:
    """Every Linear still on its plain weight gets a DenseKernel: oneDNN-packed where that pays
    (engine/linear.py), the plain weight kept elsewhere. A tied LM head gets its own packed copy
    (the embedding stays a lookup table)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.kernel.reads_parameter:
            kernel = DenseKernel(module.source_weight)
            if kernel.packed is not None:
                module.set_kernel(kernel)


def share_tied_embedding(model: nn.Module) -> bool:
    """Where the LM head is tied to the embedding and runs int8, its weight serves the lookup too
    (PackedEmbedding) and the embedding table goes. Returns whether it did."""
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    if head is None or not head.tied or not isinstance(head.kernel, Int8Weight) or inner is None:
        return False
    inner.embed_tokens = PackedEmbedding(head.kernel, inner.embed_tokens.weight.dtype)
    return True


def _on_the_fly(w: torch.Tensor, mode: str, dtype: torch.dtype, int8_rows: bool,
                keep_dense: bool = True, prompt_copy: bool = False) -> LinearKernel | None:
    """`keep_dense` False (the LM head): no dense copy for many rows; its rows are at most the
    step's sequences, but for scoring, and the int8 kernels beat dense there up to 64 rows."""
    if mode == "int8":
        q, scales = quantize_int8(w)
        return Int8Weight(q, scales, dtype, keep_dense=keep_dense, int8_rows=int8_rows)
    group = 64 if mode == "int4-g64" else 32
    if w.shape[1] % group or w.shape[0] % 16:
        return None
    q, scales, zeros = quantize_int4(w, group)
    return Int4Weight(q, scales, zeros, group, dtype, keep_dense=keep_dense, int8_rows=int8_rows,
                      prompt_copy=prompt_copy)


def _from_packed(parts: list | None, dtype: torch.dtype, device: torch.device, int8_rows: bool,
                 prompt_copy: bool) -> LinearKernel | None:
    """Packed shards of one Linear (a fused one has several): one kernel when they are alike (4-bit
    with the same input order and group size, or 8-bit groups), else one each, their outputs
    concatenated. 8-bit groups (5-bit ones sharing a Linear with 8-bit ones held 8-bit too) stay dense
    where their kernel cannot run here (None)."""
    if not parts:
        return None
    alike = {(type(p), p.group, None if p.perm is None else tuple(p.perm.tolist())) for p in parts}
    if len(alike) > 1:
        kernels = [_from_packed([p], dtype, device, int8_rows, prompt_copy) for p in parts]
        return None if None in kernels else ConcatWeight(kernels)
    q, s, z = (torch.cat([getattr(p, f) for p in parts], dim) for f, dim in (("q", 0), ("scales", 1), ("zeros", 1)))
    if isinstance(parts[0], Packed8):
        kind = Int5Weight if all(p.bits == 5 for p in parts) else Int8GroupWeight  # 5-bit beside 8: all 8
        return kind(q, s, z, dtype, parts[0].group, prompt_copy) if kind.runs_here(q.shape, dtype, device) else None
    return Int4Weight(q.to(device), s.to(device), z.to(device), parts[0].group, dtype, perm=_to(parts[0].perm, device),
                      int8_rows=int8_rows, prompt_copy=prompt_copy)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
