"""Our C kernels for the CPU, compiled once with the system's C compiler and called through
ctypes (no torch headers: it builds in about a second). If no compiler is available, callers fall
back to the torch path; `available()` says which is in use."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import threading

import torch

from engine.config import cache_dir

log = logging.getLogger("pagedchat.kernels")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, name) for name in ("paged_attention.c", "rms_norm.c", "silu_and_mul.c", "rotary.c")]
_HEADERS = [os.path.join(_CSRC, name) for name in ("bf16.h", "exp.h")]  # part of the build's cache key, not compiled alone
# fast-math lets the compiler vectorise the reductions and expf; infinities stay meaningful.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def _build() -> ctypes.CDLL | None:
    if os.environ.get("PAGEDCHAT_NO_KERNELS"):
        return None
    src = b""
    for source in _SOURCES + _HEADERS:
        with open(source, "rb") as f:
            src += f.read()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    cache = os.path.join(cache_dir(), "kernels")
    path = os.path.join(cache, f"kernels-{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [cc, *_FLAGS, *_SOURCES, "-o", tmp, "-lm"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("C kernels not built (%s %s); using the torch attention path", e, detail.decode()[:500])
            return None
        os.replace(tmp, path)
    lib = ctypes.CDLL(path)
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                     ctypes.c_int]
    lib.rotary_neox.restype = None
    lib.rotary_neox.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + \
        [ctypes.c_int64] + [ctypes.c_int] * 4
    lib.silu_and_mul.restype = None
    lib.silu_and_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def _cpu_flags() -> str:
    """-march=native builds for this CPU: a cached build is reused only on the same features."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def available() -> bool:
    global _lib, _tried
    with _lock:
        if not _tried:
            _lib, _tried = _build(), True
    return _lib is not None


def supports(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and available()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           prefix: tuple | None = None, threads: int | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; caches [num_blocks, block_size, Hkv, D]; int64 tables and lengths.
    prefix: (starts [B], rows [B], out [S, H, D] fp32, lse [S, H] fp32): sequence b attends to its
    tokens from starts[b] on, and where rows[b] >= 0 merges that with the shared prefix's partial
    out[rows[b]], lse[rows[b]] (engine/attention.py's cascade). threads: None for torch's setting."""
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    if H > 256:
        raise ValueError("paged_decode_attention supports at most 256 query heads")
    q = q.contiguous()
    out = torch.empty_like(q)
    starts, rows, prefix_out, prefix_lse = prefix or (None, None, None, None)
    failed = _lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), _ptr(starts), _ptr(rows), _ptr(prefix_out), _ptr(prefix_lse), B, H, Hkv, D, block_size,
        block_tables.shape[1], scale, 0 if q.dtype == torch.float32 else 1, threads or torch.get_num_threads())
    if failed:
        raise MemoryError("paged_decode_attention could not allocate its score buffer")
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of a contiguous CPU tensor (fp32 or bf16, weight of the same dtype).
    With `residual` (same shape and dtype, contiguous): residual += x in place first, and the sum is
    normalised."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    _lib.rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                  0 if x.dtype == torch.float32 else 1, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dim times the second half (contiguous CPU fp32 or bf16)."""
    n = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], n)
    _lib.silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, 0 if x.dtype == torch.float32 else 1,
                      torch.get_num_threads())
    return out


def rotary_neox(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided, heads contiguous);
    cos, sin [max_positions, D/2] contiguous fp32; positions [T] int64."""
    T, Hq, D = q.shape
    _lib.rotary_neox(q.data_ptr(), k.data_ptr(), q.stride(0), k.stride(0), cos.data_ptr(), sin.data_ptr(),
                     positions.data_ptr(), T, Hq, k.shape[1], D, 0 if q.dtype == torch.float32 else 1)
