"""Test fixtures only: Q4_K and Q6_K blocks from float weights (the `gguf` package dequantizes these
types but does not quantize them; no llama.cpp here). Plain round-to-nearest per sub-block, not
llama.cpp's search for the best scales, packed in llama.cpp's layout (the package's dequantizer
reads them back: tests/test_quant.py checks it)."""
from __future__ import annotations

import numpy as np


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
