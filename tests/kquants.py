"""Fixtures for tests and bench.quant: GGUF files of the default model in the types people download
(Q8_0, a Q4_K_M mix), written with the `gguf` package. It dequantizes Q4_K and Q6_K but does not
quantize them (and there is no llama.cpp here), so those blocks are made here: plain round-to-nearest
per sub-block, not llama.cpp's search for the best scales, packed in llama.cpp's layout (the
package's dequantizer reads them back: tests/test_quant.py checks it)."""
from __future__ import annotations

import functools
import re

import numpy as np

from engine.checkpoint.source import default_model_path


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K % 256 == 0) -> Q4_K blocks [rows, K / 256 * 144] uint8: per 32 weights a 6-bit
    scale and min under the super-block's fp16 d and dmin, w ~ d*sc*q - dmin*m."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, low = (hi - lo) / 15, -lo
    d, dmin = scale.max(-1, keepdims=True) / 63, low.max(-1, keepdims=True) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(low / np.where(dmin > 0, dmin, 1)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.clip(np.rint((x + (dmin * m)[..., None]) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)
    nibbles = q.reshape(-1, 4, 2, 32)
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), packed_scales, qs], axis=1).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K % 256 == 0) -> Q6_K blocks [rows, K / 256 * 210] uint8: per 16 weights an int8
    scale under the super-block's fp16 d, w ~ d*sc*(q - 32), q in 0..63."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)), 1, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.rint(x / np.where(step > 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (q & 0x0F).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1).reshape(rows, -1)


@functools.cache
def _default_model_reader():
    """One parse of the embedded model's file for every test that rewrites it (~4 s each here)."""
    import gguf

    return gguf.GGUFReader(default_model_path())


def rewritten_gguf(path: str, tensor) -> None:
    """The embedded model's GGUF with its tensors passed through `tensor(t) -> (raw data, type)`;
    its metadata copied as it is."""
    import gguf

    reader = _default_model_reader()
    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    tensors = [(t.name, *tensor(t)) for t in reader.tensors]
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()


def q8_0_gguf(path: str) -> None:
    """The default model as a Q8_0 file, as llama.cpp writes one: every matrix in Q8_0 blocks (here
    quantized by the gguf package from the embedded Q4_1 weights), the norms in F32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    def q8(t):
        if len(t.shape) < 2 or t.tensor_type == GGMLQuantizationType.F32:
            return t.data, t.tensor_type
        return quantize(dequantize(t.data, t.tensor_type), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    rewritten_gguf(path, q8)


def q4_k_m_gguf(path: str) -> None:
    """The default model as llama.cpp's Q4_K_M mix would hold it: ffn_down in Q4_K, or Q6_K in the
    layers llama.cpp gives more bits; attn_v in Q5_0, or Q8_0 there; the other matrices, whose 576
    inputs are no multiple of 256, in Q5_0 (llama.cpp's fallback for Q4_K); the embedding in Q8_0."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    layers = 30

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    def mix(t):
        if len(t.shape) < 2 or t.tensor_type == T.F32:
            return t.data, t.tensor_type
        w = dequantize(t.data, t.tensor_type)
        layer = re.match(r"blk\.(\d+)\.", t.name)
        extra = layer is not None and more_bits(int(layer.group(1)))
        if t.name.endswith("ffn_down.weight"):
            return (quantize_q6_k(w), T.Q6_K) if extra else (quantize_q4_k(w), T.Q4_K)
        kind = T.Q8_0 if t.name == "token_embd.weight" or (extra and "attn_v" in t.name) else T.Q5_0
        return quantize(w, kind), kind
    rewritten_gguf(path, mix)
