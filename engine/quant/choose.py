"""Which tiles take a layer's int8 rows, chosen by measuring on the CPU at hand.

A layer whose rows meet its weights as int8 (engine/quant/kernels.py, `int8_rows`) runs them through
AVX-512 VNNI tiles, or, where the CPU has AMX-INT8 and Linux lends it, whole tiles of 16 rows through AMX
(csrc/quant_amx.h). Both give bit-identical results, so the choice is only about speed, and that depends
on the CPU, the layer's shape and the row count: at first load each distinct shape is timed both ways at
16-256 rows, and the fewest rows from which AMX wins at every larger count becomes the layer's `amx_from`.
The answers are kept under the cache folder per CPU model, kernel build and thread count; later loads
read them instead of measuring. Measured on a Xeon with AMX (2026-12-05, 2 threads, ms, VNNI vs AMX):
3072x576 16 rows 0.51 vs 0.18, 64 rows 1.23 vs 0.61; the 49152x576 LM head 64 rows 14.0 vs 5.3.

With the engine's batch_invariant off, a 4-bit layer may also take AMX bf16 tiles (csrc/quant_amx_bf16.h),
which round differently: the same measurement against its int8 rows gives its `tiles_from` (16-32 rows
for SmolLM2's shapes on that Xeon, 2026-12-06: 3072x576 at 64 rows 0.58 vs 0.36 ms).
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch
from torch import nn

from engine import cpu_kernels
from engine.config import cache_dir
from engine.linear import Linear
from engine.quant.kernels import Int4Weight, QuantizedWeight

log = logging.getLogger("pagedchat.quant")

ROWS = (16, 32, 64, 128, 256)
REPEATS = 5  # alternating; the fastest of each counts
RUN_SECONDS = 0.002  # each timed run repeats the call this long at least: one small call is noise


def shape_key(kernel: QuantizedWeight) -> str | None:
    """What a kernel's speed depends on, or None where it has no AMX tiles (no int8 rows, fp32 rows, groups
    of 16)."""
    if (not kernel.int8_rows or getattr(kernel, "kernel_dtype", torch.bfloat16) != torch.bfloat16
            or getattr(kernel, "group_size", 32) == 16 and kernel.bits == 8):
        return None
    return f"{type(kernel).__name__} {kernel.bits}-bit {kernel.N}x{kernel.K} group {getattr(kernel, 'group_size', 0)}"


def measure(kernel: QuantizedWeight) -> int:
    """The fewest rows of ROWS from which AMX int8 tiles are faster at every larger count, or 0 (never)."""
    def rows_on(amx_from: int):
        def run(x: torch.Tensor) -> None:
            kernel.amx_from = amx_from
            kernel._packed_matmul(x)
        return run
    chosen = _fewest_rows(kernel.K, rows_on(0), rows_on(1))
    kernel.amx_from = 0
    return chosen


def measure_bf16_tiles(kernel: Int4Weight) -> int:
    """The fewest rows of ROWS from which bf16 tiles beat the int8 rows (on the tiles `amx_from` chose)
    at every larger count, or 0 (never)."""
    return _fewest_rows(kernel.K, kernel._packed_matmul, kernel._tiles_matmul)


def _fewest_rows(K: int, slow, fast) -> int:
    faster = []
    for rows in ROWS:
        x = torch.randn(rows, K).to(torch.bfloat16)
        calls = max(1, int(RUN_SECONDS / _seconds(slow, x, 1)))
        best = {slow: float("inf"), fast: float("inf")}
        for _ in range(REPEATS):
            for run in best:
                best[run] = min(best[run], _seconds(run, x, calls))
        faster.append(best[fast] < best[slow])
    chosen = 0
    for rows, wins in reversed(list(zip(ROWS, faster))):
        if not wins:
            break
        chosen = rows
    return chosen


def _seconds(run, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run(x)
    return time.perf_counter() - start


def _cache_path() -> str:
    model = next((line.partition(":")[2].strip() for line in _cpuinfo() if line.startswith("model name")), "cpu")
    name = f"{model} {cpu_kernels.build_key} {cpu_kernels.threads()} threads"
    return os.path.join(cache_dir(), "kernels", "amx-" + "".join(c if c.isalnum() else "-" for c in name) + ".json")


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


def choose_tiles(model: nn.Module, bf16_tiles: bool = False) -> dict[str, int]:
    """Set `amx_from` on every int8-row kernel of `model` and, with `bf16_tiles` (the engine's
    batch_invariant off) where the CPU has AMX-BF16, `tiles_from` on its 4-bit ones (each measured once
    per shape, cached); returns the choices per shape. Nothing to choose where the kernels have no AMX tiles."""
    if not cpu_kernels.has("amx_tiles"):
        return {}
    kernels = [m.kernel for m in model.modules() if isinstance(m, Linear) and isinstance(m.kernel, QuantizedWeight)]
    kernels += [p for k in kernels for p in getattr(k, "parts", [])]
    path = _cache_path()
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    chosen, measured = {}, False
    for kernel in kernels:
        key = shape_key(kernel)
        if key is None:
            continue
        if key not in known:
            known[key], measured = measure(kernel), True
        kernel.amx_from = chosen[key] = known[key]
        if bf16_tiles and isinstance(kernel, Int4Weight) and kernel.int8_rows and cpu_kernels.has("amx_bf16_tiles"):
            key += ", bf16 tiles"
            if key not in known:
                known[key], measured = measure_bf16_tiles(kernel), True
            kernel.tiles_from = chosen[key] = known[key]
    if measured:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, path)
    if chosen:
        log.info("AMX tiles (int8 rows; ', bf16 tiles': 4-bit layers in bf16) from these row counts (0: never), %s: %s",
                 "measured" if measured else "as measured before", chosen)
    return chosen


def amx_in_use(model: nn.Module) -> bool:
    """Whether any layer of `model` runs rows on AMX tiles (what the panel says)."""
    return any(getattr(m.kernel, "amx_from", 0) for m in model.modules() if isinstance(m, Linear))
