"""A Llama-family decoder stack as one call into our C kernels (csrc/decoder.c), for the steps and models
where every layer would call them anyway: the same kernels in the same order with the same arguments, so
the same bits, without the Python between them (module calls, ctypes glue and tensor views: about 4 ms
of a decode step of the default model, 40% of it at one session; measured on an AMD EPYC Zen 5).

Built once the weights and KV pools are final (the model runner calls the model's `fuse_layers`); a
model, or a step, it does not serve runs its modules as before.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine import cpu_kernels
from engine.attention import AttentionMetadata
from engine.config import knobs
from engine.layers import RMSNorm, SiluAndMul
from engine.linear import Linear

# csrc/kernels.h's numbers for a linear's kernel
INT4, INT4_I8, INT4_F32, INT4_F32_I8, INT5_I8, INT8, INT8_I8, INT8_F32, INT8_F32_I8, INT8G_I8 = range(10)


@functools.cache
def _kinds() -> dict:
    """(kernel type, dtype, rows rounded to int8) -> its number. Imported here, not above: the models import
    this module, and reading a checkpoint imports no quantization code (tests/test_layout.py)."""
    from engine.quant.group_kernels import Int5Weight, Int8GroupWeight
    from engine.quant.kernels import Int4Weight, Int8Weight

    return {(Int4Weight, torch.bfloat16, False): INT4, (Int4Weight, torch.bfloat16, True): INT4_I8,
            (Int4Weight, torch.float32, False): INT4_F32, (Int4Weight, torch.float32, True): INT4_F32_I8,
            (Int8Weight, torch.bfloat16, False): INT8, (Int8Weight, torch.bfloat16, True): INT8_I8,
            (Int8Weight, torch.float32, False): INT8_F32, (Int8Weight, torch.float32, True): INT8_F32_I8,
            (Int5Weight, torch.bfloat16, True): INT5_I8, (Int8GroupWeight, torch.bfloat16, True): INT8G_I8}


def _linear_fields(linear: Linear, dtype: torch.dtype) -> list[int] | None:
    """A linear as csrc/decoder.c reads it (kind, packed, scales, N, K, group, amx_from, tiles_from, bias), or
    None where its Python kernel would not call one of ours (a dense weight, an act-order permutation,
    another dtype)."""
    k, bias = linear.kernel, linear.bias
    if getattr(k, "perm", None) is not None or (bias is not None and bias.dtype != dtype):
        return None
    kernel_dtype = getattr(k, "kernel_dtype", torch.bfloat16)
    kind = _kinds().get((type(k), dtype, bool(getattr(k, "int8_rows", False)))) if kernel_dtype is dtype else None
    if kind is None:
        return None
    int8 = kind in (INT8, INT8_I8, INT8_F32, INT8_F32_I8)  # Int8Weight: its own names
    packed, scales = (k.q, k.scales) if int8 else (k.packed, k.scales_and_zeros)
    return [kind, packed.data_ptr(), scales.data_ptr(), k.N, k.K, getattr(k, "group_size", 0), k.amx_from,
            k.tiles_from, 0 if bias is None else bias.data_ptr()]


class FusedLayers:
    """The decoder layers' weights and pools as one table of pointers, run by csrc/decoder.c."""

    def __init__(self, layers: nn.ModuleList, table: list[list[int]], limits: set[tuple[int, int]],
                 dtype: torch.dtype) -> None:
        first = layers[0]
        attn, self.rotary = first.self_attn.attn, first.self_attn.rotary
        self.layers = layers  # what the table points into stays alive with it
        self.table = torch.tensor(table, dtype=torch.int64)
        self.shape = torch.tensor([first.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads,
                                   attn.head_dim, 0 if dtype == torch.float32 else 1, int(attn.int8 is not None),
                                   attn.block_size], dtype=torch.int64)
        self.eps, self.scale, self.dtype = first.input_layernorm.eps, attn.scale, dtype
        self.head_dim, self.block_size = attn.head_dim, attn.block_size
        self.limits = limits  # (all_rows, small_m) of the linears that keep a dense copy (serves)

    @classmethod
    def build(cls, layers: nn.ModuleList) -> FusedLayers | None:
        """The stack as one call, or None where some layer would leave our kernels (_layer_fields)."""
        if knobs().no_fused_layers or not cpu_kernels.serves_here() or not len(layers):
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        table, limits = [], set()
        for layer in layers:
            row = _layer_fields(layer, layers[0], dtype)
            if row is None:
                return None
            table.append(row)
            limits |= {(m.kernel.all_rows, m.kernel.small_m) for m in _linears(layer) if m.kernel.dense is not None}
        return cls(layers, table, limits, dtype)

    def serves(self, h: torch.Tensor, meta: AttentionMetadata | None) -> bool:
        """Whether this step's rows are all attended one by one (a cascade's prefix by our kernel), and every
        linear takes its packed kernel for all of them (quant/kernels.py's packed_rows: a linear with a dense
        copy gives it prompt rows beyond its all_rows, and decode rows beyond its small_m)."""
        if meta is None or meta.prefills or not cpu_kernels.supports(h) or h.dtype != self.dtype \
                or meta.row_seq_lens is None or meta.row_seq_lens.shape[0] != h.shape[0]:
            return False
        if meta.shared is not None and not cpu_kernels.prefix_kernel(self.dtype, self.head_dim, self._tokens(meta)):
            return False  # torch's flash attention would take the prefix
        rows, decodes = h.shape[0], meta.num_decode
        return all(rows <= all_rows or (decodes == rows and rows <= small_m) for all_rows, small_m in self.limits)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """h [T, hidden] embeddings -> (the last layer's output, the residual stream: h, updated in place)."""
        out = cpu_kernels.decoder_layers(self.table, self.shape, h, positions, self.rotary.cos, self.rotary.sin,
                                         meta.slot_mapping, meta.row_block_tables, meta.row_seq_lens, self.eps,
                                         self.scale, meta.kernel_threads, self._cascade(meta))
        return out, h

    def _tokens(self, meta: AttentionMetadata) -> int:
        return meta.shared.block_ids.shape[0] * self.block_size

    def _cascade(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """csrc/kernels.h's PC_CASCADE_* fields for this step's shared prefix (None without one): every layer's
        prefix operands made or kept first, as the modules make them at that layer's turn (its full blocks
        are written by earlier steps, so the same bits)."""
        shared = meta.shared
        if shared is None:
            return None
        attns = (layer.self_attn.attn for layer in self.layers)
        operands = [t.data_ptr() for attn in attns for t in attn.shared_operands(shared, self.dtype)]
        return torch.tensor([shared.rows.shape[0], self._tokens(meta), shared.rows.data_ptr(), shared.starts.data_ptr(),
                             shared.prefix_row.data_ptr(), *operands], dtype=torch.int64)


def _linears(layer: nn.Module) -> tuple[Linear, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_fields(layer: nn.Module, first: nn.Module, dtype: torch.dtype) -> list[int] | None:
    """One layer's row of the table, or None where it would leave our kernels: a layer other than
    Llama's, a sliding window, a softcap, norms of another kind, eps or dtype, another activation."""
    from engine.models.llama import LlamaDecoderLayer

    if type(layer) is not LlamaDecoderLayer:
        return None
    sa, mlp = layer.self_attn, layer.mlp
    attn, norms = sa.attn, (layer.input_layernorm, layer.post_attention_layernorm)
    qk_norms = (sa.q_norm, sa.k_norm) if sa.qk_norm else ()
    if attn.window is not None or not attn.kernels or not attn.stores or not sa.rotary.kernels:
        return None
    if sa.qk_norm != first.self_attn.qk_norm or any(type(n) is not RMSNorm for n in qk_norms):
        return None
    if sa.rotary is not first.self_attn.rotary or attn.scale != first.self_attn.attn.scale or attn.head_dim > 512:
        return None
    if attn.int8 is not None and not attn.int8_kernel(dtype):
        return None
    if any(n.eps != first.input_layernorm.eps or n.weight.dtype != dtype or not n.kernels for n in norms + qk_norms):
        return None
    if type(mlp.act) is not SiluAndMul or not mlp.act.kernels:
        return None
    if not (attn.k_cache.numel() and attn.k_cache.is_contiguous() and attn.v_cache.is_contiguous()):
        return None
    linears = [_linear_fields(m, dtype) for m in _linears(layer)]
    if any(f is None for f in linears):
        return None
    row = [n.weight.data_ptr() for n in norms] + ([n.weight.data_ptr() for n in qk_norms] or [0, 0])
    row += [attn.k_cache.data_ptr(), attn.v_cache.data_ptr()]
    for fields in linears:
        row += fields
    return row
