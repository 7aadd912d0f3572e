"""GGUF weights read once with the `gguf` package: llama.cpp tensor names mapped to transformers
names, llama.cpp's q/k row permutation undone, the blocks our kernels run (4-, 5-, 6- and 8-bit) kept
packed when asked. (The config and tokenizer come from checkpoint/source.py.)"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.checkpoint.quantized import Packed4, Packed8

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_Q4_BLOCK_BYTES = {2: 18, 3: 20, 12: 144}  # GGMLQuantizationType Q4_0, Q4_1 (32 weights), Q4_K (256)
_INT8_GROUP_TYPES = {8: "Q8_0", 6: "Q5_0", 7: "Q5_1", 13: "Q5_K", 14: "Q6_K"}  # Packed8: groups of 32 (Q6_K: 16)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    m = _LAYER_RE.match(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return part and f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    top = _TOP_NAMES.get(base)
    return top and f"{top}.{kind}"


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores llama q/k rows interleaved per head; put them back in HF order."""
    n = w.shape[0]
    return w.reshape(num_heads, n // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int
    data: np.ndarray  # as GGUFReader gives it: a view of the file (raw bytes [rows, bytes] where quantized)


def gguf_tensors(path: str) -> tuple[str, list[GGUFTensor]]:
    """The file's architecture and tensors: where, of what type and of what shape each tensor lies is
    kept beside the converted config after the first read, and later loads map the file and take
    views at those offsets."""
    from engine.checkpoint.source import gguf_cache_folder

    index_file = gguf_cache_folder(path) + ".tensors.json"
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = _read_index(path)
        try:
            os.makedirs(os.path.dirname(index_file), exist_ok=True)
            with open(f"{index_file}.tmp{os.getpid()}", "w") as f:
                json.dump(index, f)
            os.replace(f"{index_file}.tmp{os.getpid()}", index_file)
        except OSError:
            pass  # a read-only home only costs the parse at the next load
    data = np.memmap(path, mode="r")
    tensors = []
    for name, kind, offset, dtype, shape in index["tensors"]:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if offset + n > data.size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, kind, data[offset:offset + n].view(dtype).reshape(shape)))
    return index["arch"], tensors


_VALUE_DTYPES = {0: "<f4", 1: "<f2", 24: "|i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}  # F32, F16, I8..F64


def _read_index(path: str) -> dict:
    """Each tensor as GGUFReader shapes it: values in their numpy type, anything else (blocks, BF16)
    as raw bytes [rows, bytes per row]. Through transformers' header reader (milliseconds; GGUFReader
    parses every metadata value first, ~4 s for SmolLM2), or GGUFReader where a block type is one
    that reader does not size (Q5_0, Q5_1)."""
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(path)
    except ValueError:
        return _read_index_slowly(path)
    tensors = []
    for t in header.tensors:
        dtype = _VALUE_DTYPES.get(t.ggml_type, "|u1")
        shape = list(t.shape)
        if dtype == "|u1":
            shape = shape[:-1] + [t.nbytes // int(np.prod(shape[:-1]))]
        tensors.append((t.name, t.ggml_type, header.data_start + t.offset, dtype, shape))
    return {"arch": header.architecture, "tensors": tensors}


def _read_index_slowly(path: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    return {"arch": reader.fields["general.architecture"].contents(),
            "tensors": [(t.name, int(t.tensor_type), int(t.data_offset), t.data.dtype.str, list(t.data.shape))
                        for t in reader.tensors]}


def gguf_weights(path: str, hf_config, keep_packed: bool = False) -> Iterator[tuple[str, torch.Tensor | Packed4 | Packed8]]:
    """Every tensor once, under its transformers name. With `keep_packed`, the projections' blocks
    stay packed, read from the raw bytes (no float round trip): Q4_0 / Q4_1 / Q4_K as Packed4, Q8_0 /
    Q6_K as Packed8, Q5_0 / Q5_1 / Q5_K as Packed8 of 5 bits; everything else is dequantized to fp32."""
    from gguf.quants import dequantize

    arch, tensors = gguf_tensors(path)
    for t in tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {arch} model")
        heads = None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
        if keep_packed and t.tensor_type in _Q4_BLOCK_BYTES and name.endswith("proj.weight"):
            yield name, _packed_from_blocks(t, heads)
            continue
        if keep_packed and t.tensor_type in _INT8_GROUP_TYPES and name.endswith("proj.weight"):
            yield name, _int8_groups(t, heads)
            continue
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        yield name, unpermute_rows(w, heads) if heads else w


def _packed_from_blocks(t, heads: int | None) -> Packed4:
    """A Q4_0 / Q4_1 / Q4_K tensor in the int4 kernel's convention (groups of 32), straight from its blocks."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.Q4_K:
        q, d, zeros = _q4_k_groups(t.data)
    else:
        block = _Q4_BLOCK_BYTES[t.tensor_type]
        rows = t.data.shape[0]
        raw = np.ascontiguousarray(t.data).reshape(rows, -1, block)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zeros = m + 8 * d  # x = d*q + m  ==  (q - 8)*d + (m + 8d)
        else:
            zeros = np.zeros_like(d)  # x = d*(q - 8)
        nibbles = raw[..., block - 16:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1).astype(np.int32)
    q, d, zeros = torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros)
    if heads:
        q, d, zeros = (unpermute_rows(x, heads) for x in (q, d, zeros))
    return Packed4(q, d.T.contiguous(), zeros.T.contiguous(), None, 32)


def _q4_k_groups(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (256 weights: fp16 d and dmin, eight 6-bit scales and mins, 4-bit q) as
    groups of 32 in the int4 convention: x = d*sc*q - dmin*m == (q - 8)*scale + zero with
    scale = d*sc, zero = 8*scale - dmin*m. Returns q [N, K] int32, scale and zero [N, K/32] fp32."""
    from gguf.quants import Q4_K

    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(-1, 144)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])  # [B, 8] each: the library's unpacking of the 6-bit fields
    scale, low = d * sc.astype(np.float32), dmin * m.astype(np.float32)
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, -1).astype(np.int32)  # group 2c: the low nibbles of 32 bytes, 2c+1 the high
    return q, scale.reshape(rows, -1), (8 * scale - low).reshape(rows, -1)


def _int8_groups(t, heads: int | None) -> Packed8:
    """A Q8_0 / Q5_0 / Q5_1 / Q5_K tensor as integers in groups of 32 (the 5-bit ones marked so), a
    Q6_K one in groups of 16: w = q * scale + zero, exactly. The integers come from the gguf package's own dequantizer run on
    the same blocks with their scales set to one and their mins to zero (its bit unpacking, not a
    copy of it); the scales and mins are the blocks' own."""
    import gguf
    from gguf.quants import Q4_K, dequantize

    kinds = gguf.GGMLQuantizationType
    kind = kinds(t.tensor_type)
    rows = t.data.shape[0]
    raw = np.ascontiguousarray(t.data).reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    unit, one = raw.copy(), np.array([1.0], dtype=np.float16).view(np.uint8)

    def half(at: int) -> np.ndarray:  # the fp16 at byte `at` of every block, [blocks, 1]
        return raw[:, at:at + 2].copy().view(np.float16).astype(np.float32)
    if kind == kinds.Q6_K:  # sixteen int8 scales per 16 weights, then d, at the end of the block
        unit[:, 192:208], unit[:, 208:210] = 1, one
        scale = half(208) * raw[:, 192:208].view(np.int8).astype(np.float32)
        zero = np.zeros_like(scale)
    elif kind == kinds.Q5_K:  # eight sub-blocks of 32: d*sc and dmin*m each
        unit[:, 0:2], unit[:, 2:4] = one, 0
        unit[:, 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]  # every 6-bit scale 1, every min 0
        sc, m = Q4_K.get_scale_min(raw[:, 4:16])
        scale, zero = half(0) * sc.astype(np.float32), -half(2) * m.astype(np.float32)
    elif kind == kinds.Q5_1:  # w = d*q + m
        unit[:, 0:2], unit[:, 2:4] = one, 0
        scale, zero = half(0), half(2)
    else:  # Q8_0, Q5_0: w = d*q (Q5_0's q already centred by the dequantizer)
        unit[:, 0:2] = one
        scale = half(0)
        zero = np.zeros_like(scale)
    q = torch.from_numpy(np.rint(dequantize(unit.reshape(rows, -1), kind)).astype(np.int8))
    scale, zero = (torch.from_numpy(np.ascontiguousarray(x).reshape(rows, -1)) for x in (scale, zero))
    if heads:
        q, scale, zero = (unpermute_rows(x, heads) for x in (q, scale, zero))
    return Packed8(q, scale.T.contiguous(), zero.T.contiguous(), 16 if kind == kinds.Q6_K else 32,
                   5 if kind in (kinds.Q5_0, kinds.Q5_1, kinds.Q5_K) else 8)
