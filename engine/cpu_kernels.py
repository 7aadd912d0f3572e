"""Our C kernels for the CPU, compiled once with the system's C compiler (engine/kernel_build.py) and
called through ctypes (no torch headers: it builds in about a second). If no compiler is available,
callers fall back to the torch path; `available()` says which is in use. Layers ask once, at
construction (`serves_here()`), not on every call. Error codes and feature bits: csrc/common.h, csrc/kernels.h.
The quantized matmuls' wrappers are engine/quant/cpu_matmul.py."""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from engine.kernel_build import build

_lib: ctypes.CDLL | None = None
_tried = False
_features = 0  # pagedchat_features() of the build (csrc/kernels.h's PC_FEATURE_* bits)
FEATURES = {"bf16_attention": 1, "quant_bf16": 2, "quant_f32": 4, "f32_attention": 8, "amx_tiles": 16,
            "amx_bf16_tiles": 32}
# csrc/common.h's return codes
OK, UNSUPPORTED, NO_MEMORY, BAD_SHAPE = 0, -1, -2, -3
build_key = ""  # names the build: its sources, compiler, flags and this CPU's features
_threads = len(os.sched_getaffinity(0))
_lock = threading.Lock()


def available() -> bool:
    """Whether the kernels are built (built on the first call; no lock once they are)."""
    global _lib, _tried, _features, build_key
    if not _tried:
        with _lock:
            if not _tried:
                _lib, build_key = build()
                _features = _lib.pagedchat_features() if _lib is not None else 0
                _tried = True
    return _lib is not None


def has(feature: str) -> bool:
    """Whether the build has one of the vectorised paths named in FEATURES."""
    return available() and bool(_features & FEATURES[feature])


def serves_here() -> bool:
    """For a layer being built: whether our kernels may serve it (a CPU model, the kernels built).
    Layers keep the answer; per call they check only their tensors' dtype and layout (supports)."""
    return torch.get_default_device().type == "cpu" and available()


def check(code: int, kernel: str) -> None:
    """A kernel's return code (csrc/common.h) as the exception it means."""
    if code == NO_MEMORY:
        raise MemoryError(f"{kernel} could not allocate its buffers")
    if code == BAD_SHAPE:
        raise ValueError(f"{kernel} does not take these shapes")
    if code == UNSUPPORTED:
        raise RuntimeError(f"{kernel} is not in this build (this CPU lacks its instructions)")
    if code != OK:
        raise RuntimeError(f"{kernel} failed with code {code}")


def library() -> ctypes.CDLL:
    """The built library, for the kernels' other wrappers (engine/quant/cpu_matmul.py); after available()."""
    return _lib


def set_threads(n: int) -> None:
    """How many threads our kernels split their work over (the engine's num_threads). Independent of
    torch's setting, which the model runner lowers to one for few-row steps: waking torch's sleeping
    threads costs more than those ops, while ours stay warm through a step (csrc/pool.c)."""
    global _threads
    _threads = max(1, int(n))


def threads() -> int:
    return _threads


def supports(t: torch.Tensor) -> bool:
    """Whether a tensor is one our kernels take (a CPU fp32 or bf16 one); the caller has checked
    that they are built (serves_here / available)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           prefix: tuple | None = None, threads: int | None = None,
                           int8: tuple[int, int] | None = None) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, heads contiguous) -> out [B, H, D] (contiguous), returned; k_cache
    [num_blocks, Hkv, D/2, block_size, 2], v_cache [num_blocks, block_size, Hkv, D]; int64 tables, lengths.
    int8: (block_size, Hkv) of int8 pools (kv_layout.int8_views' bytes, [num_blocks, bytes]; bf16 q on
    AVX-512 BF16 and VNNI, fp32 q on AVX2).
    prefix: (starts [B], rows [B], out [S, H, D] fp32, lse [S, H] fp32): sequence b attends to its
    tokens from starts[b] on, and where rows[b] >= 0 merges that with the shared prefix's partial
    out[rows[b]], lse[rows[b]] (engine/cascade.py). threads: None for set_threads'."""
    B, H, D = q.shape
    block_size, Hkv = int8 or v_cache.shape[1:3]
    if H > 256:
        raise ValueError("paged_decode_attention supports at most 256 query heads")
    if not heads_contiguous(q):
        q = q.contiguous()
    starts, rows, prefix_out, prefix_lse = prefix or (None, None, None, None)
    dtype = (3 if q.dtype == torch.float32 else 2) if int8 else _dtype_code(q)  # csrc/paged_attention.c's codes
    code = _lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), _ptr(starts), _ptr(rows), _ptr(prefix_out), _ptr(prefix_lse), B, H, Hkv, D, block_size,
        block_tables.shape[1], scale, dtype, threads or _threads)
    check(code, "paged_decode_attention")
    return out


def prefix_kernel(dtype: torch.dtype, head_dim: int, tokens: int) -> bool:
    """Whether prefix_attention serves a shared prefix of `tokens` tokens (bf16 on AVX-512 BF16)."""
    return (has("bf16_attention") and dtype == torch.bfloat16 and head_dim in (64, 128) and tokens % 16 == 0
            and tokens > 0)


def prefix_attention(q: torch.Tensor, kt: torch.Tensor, vp: torch.Tensor, scale: float,
                     threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, H, D] bf16 (heads contiguous) against a shared prefix laid out as kt [Hkv, D/2, P, 2] and
    vp [Hkv, P/2, D, 2] (csrc/prefix_attention.c) -> (out [S, H, D] fp32 normalised, lse [S, H] fp32)."""
    (S, H, D), (Hkv, _, P, _) = q.shape, kt.shape
    q = q if heads_contiguous(q) else q.contiguous()
    out, lse = torch.empty(S, H, D, dtype=torch.float32), torch.empty(S, H, dtype=torch.float32)
    check(_lib.prefix_attention(q.data_ptr(), q.stride(0), kt.data_ptr(), vp.data_ptr(), out.data_ptr(),
                                 lse.data_ptr(), S, H, Hkv, D, P, scale, threads or _threads), "prefix_attention")
    return out, lse


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (rows strided, heads contiguous) into their slots (paged_decode_attention's layouts)."""
    T, Hkv, D = k.shape
    _lib.kv_store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                  slots.data_ptr(), T, Hkv, D, v_cache.shape[1], _dtype_code(k), _threads)


def kv_store_int8(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                  block_size: int) -> None:
    """kv_store into int8 pools ([num_blocks, bytes], kv_layout.int8_views), each row of each head rounded
    to int8 with its own scale; k, v fp32 or bf16, head_dim <= 512."""
    T, Hkv, D = k.shape
    _lib.kv_store_int8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                       slots.data_ptr(), T, Hkv, D, block_size, _dtype_code(k), _threads)


def decoder_layers(table: torch.Tensor, shape: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, eps: float, scale: float, attention_threads: int | None,
                   cascade: torch.Tensor | None = None) -> torch.Tensor:
    """A Llama-family decoder stack in one call (csrc/decoder.c; engine/fused_layers.py builds `table`,
    `shape` and `cascade`): h [T, hidden] contiguous, the embeddings, becomes the residual stream in place;
    returns the last layer's output. The other arguments as rotary_neox's, kv_store's and
    paged_decode_attention's; cascade: None, or csrc/kernels.h's PC_CASCADE_* fields (int64)."""
    out = torch.empty_like(h)
    code = _lib.decoder_layers(table.data_ptr(), table.shape[0], shape.data_ptr(), h.data_ptr(), out.data_ptr(),
                               h.shape[0], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                               block_tables.data_ptr(), seq_lens.data_ptr(), block_tables.shape[1], eps, scale,
                               _threads, attention_threads or _threads, _ptr(cascade))
    if code:
        check(code, "decoder_layers")
    return out


def heads_contiguous(x: torch.Tensor) -> bool:
    """[T, H, D] with each row's H * D elements contiguous."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _dtype_code(t: torch.Tensor) -> int:
    """The C kernels' dtype argument: 0 float32, 1 bfloat16."""
    return 0 if t.dtype == torch.float32 else 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of a contiguous CPU tensor (fp32 or bf16, weight of the same dtype).
    With `residual` (same shape and dtype, contiguous): residual += x in place first, and the sum is
    normalised."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _lib.rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                  _dtype_code(x), _threads)
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, H, D] (heads contiguous, tokens strided: a view of a qkv output; Qwen3's
    q and k norms) -> a new contiguous [T, H, D]; rms_norm's arithmetic."""
    out = torch.empty(x.shape, dtype=x.dtype)
    T, H, D = x.shape
    _lib.rms_norm_heads(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), T, H, D, eps, _dtype_code(x),
                        _threads)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dim times the second half (contiguous CPU fp32 or bf16)."""
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    _lib.silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, _dtype_code(x),
                      _threads)
    return out


def int8_rows_lookup(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (int64, contiguous) of an int8-row packed weight ([N/16, K/4, 64] uint8, quant/packing.py's
    int8_pack) times their fp32 scales, as [len(ids), K] in `dtype` (fp32 or bf16): csrc/embedding.c. An id
    outside the weight's rows is an IndexError, as torch's indexing makes it."""
    N, K = packed.shape[0] * 16, packed.shape[1] * 4
    out = torch.empty(ids.shape[0], K, dtype=dtype)
    if _lib.int8_rows_lookup(packed.data_ptr(), scales.data_ptr(), ids.data_ptr(), out.data_ptr(), ids.shape[0], N, K,
                             _dtype_code(out)):
        raise IndexError(f"token ids must be in [0, {N})")
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The first maximum's index in each row of a contiguous CPU float32 [rows, n] (a NaN counts as
    the maximum), as torch.argmax(dim=-1)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    _lib.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], _threads)
    return out


def rotary_neox(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided, heads contiguous);
    cos, sin [max_positions, D/2] contiguous fp32; positions [T] int64."""
    T, Hq, D = q.shape
    _lib.rotary_neox(q.data_ptr(), k.data_ptr(), q.stride(0), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                     positions.data_ptr(), T, Hq, k.shape[1], D, _dtype_code(q))
