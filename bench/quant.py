"""Quantization benchmark: weight bytes, quality (mean NLL on a passage that is not the
calibration text) and generated tokens/s at 1 and 32 sessions, for bf16, int8, int4, GGUF-Q4_1
kept packed, our GPTQ, and GGUF files of the types people download (Q8_0 and a Q4_K_M mix, written
by tests/kquants.py), all on SmolLM2 in one process. Also the row count at which the packed
kernels stop beating dense bf16 (the engine's SMALL_M, OUR_SMALL_M where our C kernels run).

    python -m bench.quant [--concurrency 1 32] [--turns 2]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.throughput import run_pagedchat
from engine import LLM
from engine.linear import DenseKernel
from engine.quant.gptq import quantize_checkpoint
from engine.quant.kernels import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from tests.kquants import q4_k_m_gguf, q8_0_gguf

PASSAGE = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "eval_passage.txt")


def kernel_sweep(rows=(1, 2, 4, 8, 16, 32)) -> list[tuple[int, float, float, float]]:
    """Median µs of a 576->1536 matmul: dense bf16 (packed as the engine does), packed int4 (g32),
    packed int8, by row count."""
    w = torch.randn(1536, 576)
    dense = DenseKernel(w.bfloat16())
    int4 = Int4Weight(*quantize_int4(w, 32), 32, torch.bfloat16, keep_dense=False)
    int8 = Int8Weight(*quantize_int8(w), torch.bfloat16, keep_dense=False)
    out = []
    for m in rows:
        x = torch.randn(m, 576).bfloat16()
        times = [_median_us(lambda: dense(x)), _median_us(lambda: int4.matmul(x)),
                 _median_us(lambda: int8.matmul(x))]
        out.append((m, *times))
    return out


def _median_us(fn, n=50) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[n // 2] * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--turns", type=int, default=2)
    args = p.parse_args()
    text = open(PASSAGE).read()
    with tempfile.TemporaryDirectory() as gptq_dir, tempfile.TemporaryDirectory() as gguf_dir:
        quantize_checkpoint(None, gptq_dir, group_size=64)
        q8_0, q4_k_m = os.path.join(gguf_dir, "q8_0.gguf"), os.path.join(gguf_dir, "q4_k_m.gguf")
        q8_0_gguf(q8_0)
        q4_k_m_gguf(q4_k_m)
        variants = [("bf16", {"quantization": "none"}), ("int8", {"quantization": "int8"}),
                    ("int4 (g32)", {"quantization": "int4"}), ("GGUF Q4_1 packed", {"quantization": "gguf"}),
                    ("GPTQ g64 (ours)", {"model": gptq_dir}), ("GGUF Q8_0 packed", {"model": q8_0}),
                    ("GGUF Q4_K_M mix packed", {"model": q4_k_m})]
        rows = []
        for name, options in variants:
            llm = LLM(dtype="bfloat16", **options)
            ids = llm.get_tokenizer().encode(text)
            nll = llm.mean_nll(ids)
            speeds = [run_pagedchat(llm, c, args.turns, 0)["tok_s"] for c in args.concurrency]
            rows.append((name, llm.engine.weight_bytes, nll, speeds))
            del llm
    base = rows[0]
    print(f"\n| variant | weight MiB | NLL | " + " | ".join(f"tok/s @{c}" for c in args.concurrency) + " |")
    print("|---|---|---|" + "---|" * len(args.concurrency))
    for name, size, nll, speeds in rows:
        cells = " | ".join(f"{s:.0f} ({s / b:.2f}x)" for s, b in zip(speeds, base[3]))
        print(f"| {name} | {size / 2**20:.0f} | {nll:.4f} ({nll / base[2] - 1:+.1%}) | {cells} |")
    print("\nweight MiB: what the weights take resident (with any dense copy a kernel keeps: int8 mode keeps one).")
    print("\n| rows | dense bf16 µs | int4 µs | int8 µs |\n|---|---|---|---|")
    for m, d, i4, i8 in kernel_sweep():
        print(f"| {m} | {d:.0f} | {i4:.0f} | {i8:.0f} |")


if __name__ == "__main__":
    main()
