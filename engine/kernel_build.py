"""How our C kernels are built: the sources, the flags, one compile with the system's C compiler into the
cache folder (named by a key of the sources, compiler, flags and this CPU's features, so a cached build is
reused only where it was made), and the ctypes signatures of what it exports. engine/cpu_kernels.py loads
it once and calls it."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess

from engine.config import cache_dir, cpu_flags, knobs

log = logging.getLogger("pagedchat.kernels")

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, name) for name in ("paged_attention.c", "prefix_attention.c", "kv_store.c",
                                                      "rms_norm.c", "silu_and_mul.c", "rotary.c", "argmax.c",
                                                      "quant_matmul.c", "quant_matmul_f32.c", "quant_int8_rows_f32.c",
                                                      "pool.c", "features.c", "decoder.c", "embedding.c")]
# part of the build's cache key, not compiled alone
_HEADERS = [os.path.join(_CSRC, name) for name in ("attention_amx.h", "attention_f32.h", "attention_int8.h",
                                                      "common.h", "exp.h", "kernels.h", "pool.h", "quant_amx.h",
                                                      "quant_amx_bf16.h", "quant_int8_rows.h")]
# fast-math lets the compiler vectorise the reductions and expf; infinities stay meaningful. OpenMP
# only for its simd hints: the threads are our own (csrc/pool.c), torch's runtime stays the only one.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp-simd", "-pthread", "-shared",
          "-fPIC"]


def build() -> tuple[ctypes.CDLL | None, str]:
    """The library (None where the kernels are off or do not build) and its build key, which names the
    sources, compiler, flags and this CPU's features."""
    if knobs().no_kernels:
        return None, ""
    src = b""
    for source in _SOURCES + _HEADERS:
        with open(source, "rb") as f:
            src += f.read()
    cc = knobs().cc
    # -march=native builds for this CPU: a cached build is reused only on the same features
    features = sorted(cpu_flags())
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, platform.machine(), *features]).encode()).hexdigest()[:16]
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
            return None, key
        os.replace(tmp, path)
    lib = ctypes.CDLL(path)
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    matmul4, matmul8 = (ctypes.c_int, [ptr] * 4 + [i32] * 5), (ctypes.c_int, [ptr] * 4 + [i32] * 4)
    matmul4_i8, matmul8_i8 = (ctypes.c_int, [ptr] * 4 + [i32] * 6), (ctypes.c_int, [ptr] * 4 + [i32] * 5)
    signatures = {  # name: (return type, argument types)
        "pagedchat_features": (ctypes.c_int, []),
        "paged_decode_attention": (ctypes.c_int, [ptr, i64] + [ptr] * 9 + [i32] * 6 + [f32, i32, i32]),
        "prefix_attention": (ctypes.c_int, [ptr, i64] + [ptr] * 4 + [i32] * 4 + [i64, f32, i32]),
        "kv_store": (None, [ptr, i64] * 2 + [ptr] * 3 + [i64] + [i32] * 5),
        "kv_store_int8": (None, [ptr, i64] * 2 + [ptr] * 3 + [i64] + [i32] * 5),
        "rms_norm": (None, [ptr] * 4 + [i64, i32, f32, i32, i32]),
        "rms_norm_heads": (None, [ptr, i64, ptr, ptr, i64, i32, i32, f32, i32, i32]),
        "rotary_neox": (None, [ptr] * 2 + [i64] * 2 + [ptr] * 3 + [i64] + [i32] * 4),
        "silu_and_mul": (None, [ptr] * 2 + [i64, i32, i32, i32]),
        "argmax_rows": (None, [ptr] * 2 + [i64] * 2 + [i32]),
        "int8_rows_lookup": (ctypes.c_int, [ptr] * 4 + [i64, i32, i32, i32]),
        "amx_tiles_computed": (i64, []),
        "int4_matmul": matmul4, "int4_matmul_bf16_tiles": matmul4, "int4_matmul_i8": matmul4_i8,
        "int4_matmul_f32": matmul4, "int5_matmul_i8": matmul4_i8, "int4_matmul_f32_i8": matmul4,
        "int8_matmul": matmul8, "int8_matmul_i8": matmul8_i8, "int8_matmul_f32": matmul8, "int8g_matmul_i8": matmul4_i8,
        "int8_matmul_f32_i8": matmul8,
        "decoder_layers": (ctypes.c_int, [ptr, i32, ptr, ptr, ptr, i32] + [ptr] * 6 + [i32, f32, f32, i32, i32, ptr]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, key
