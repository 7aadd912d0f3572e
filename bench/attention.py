"""Decode attention with and without the shared-prefix cascade, in one process.

    python -m bench.attention                      # SmolLM2's shapes, 304-token shared prefix
    python -m bench.attention --prefix 2048 --no-step   # a long shared prefix, where the cascade pays

1. The attention alone: B decodes sharing a P-token prefix, each with its own S-token suffix
   (9 query heads, 3 kv heads, head dim 64, block size 16, the dtype the engine picks on this CPU:
   bf16 with AVX-512 BF16, else fp32): the C kernel over each whole
   sequence, against the cascade (the prefix once for all rows as matrix products, by our kernel
   where it serves, else torch's CPU flash attention; the kernel over the suffixes, merged; the
   prefix's operands are reused across steps, as in the engine).
2. A whole decode step at batch 64 on the default model (bench.throughput's sessions, so every
   sequence shares the system prompt), cascade on and off.
"""
from __future__ import annotations

import argparse
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from engine import LLM, cascade
from engine.config import EngineConfig
from engine.attention import AttentionMetadata, PagedAttention
from engine.cascade import find_shared_prefix
from engine.kv_layout import key_pairs


def timed(fn, repeat: int) -> float:
    """ms per call: the best of five rounds of `repeat` calls (this box's noise is large)."""
    fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        rounds.append((time.perf_counter() - t0) / repeat * 1000)
    return min(rounds)


def attention_alone(batch: int, prefix: int, suffix: int, repeat: int, dtype: torch.dtype) -> tuple[float, float]:
    H, Hkv, D, bs = 9, 3, 64, 16
    shared_blocks, own_blocks = prefix // bs, -(-suffix // bs)
    num_blocks = shared_blocks + batch * own_blocks + 1
    attn = PagedAttention(H, Hkv, D, D ** -0.5)
    attn.k_cache = key_pairs(torch.randn(num_blocks, bs, Hkv, D, dtype=dtype))
    attn.v_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype)
    tables = [list(range(shared_blocks)) + [shared_blocks + b * own_blocks + i for i in range(own_blocks)]
              for b in range(batch)]
    table, lens = torch.tensor(tables), torch.full((batch,), shared_blocks * bs + suffix)
    q = torch.randn(batch, H, D, dtype=dtype)
    plain = AttentionMetadata(torch.empty(0, dtype=torch.long), batch, table, lens)
    hashes = [list(range(shared_blocks + own_blocks))] * batch  # a known prefix: its K/V operands are reused
    threshold, cascade.MIN_SHARING_ROWS = cascade.MIN_SHARING_ROWS, 1  # forced, to show where it pays
    tokens, cascade.MIN_SHARED_TOKENS = cascade.MIN_SHARED_TOKENS, 0
    sharing = AttentionMetadata(torch.empty(0, dtype=torch.long), batch, table, lens,
                                shared=find_shared_prefix(table, lens, bs, hashes))
    cascade.MIN_SHARING_ROWS, cascade.MIN_SHARED_TOKENS = threshold, tokens
    return timed(lambda: attn._decode(q, plain), repeat), timed(lambda: attn._decode(q, sharing), repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=304)
    p.add_argument("--suffix", type=int, default=150)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--no-step", action="store_true", help="skip the whole-step measurement")
    args = p.parse_args()
    dtype = EngineConfig().resolved_dtype(torch.device("cpu"))
    print(f"{torch.get_num_threads()} threads, {dtype}; attention alone, one layer, prefix {args.prefix} + own "
          f"{args.suffix} tokens per sequence")
    print(f"(the engine uses the cascade from {cascade.MIN_SHARING_ROWS} decodes sharing "
          f"{cascade.shared_tokens_needed(dtype, 64)} tokens on)")
    print("| decodes | per-sequence kernel | cascade | ratio |")
    print("|---|---|---|---|")
    for batch in (4, 8, 16, 32, 48, 64):
        plain, cascaded = attention_alone(batch, args.prefix, args.suffix, args.repeat, dtype)
        print(f"| {batch} | {plain:.2f} ms | {cascaded:.2f} ms | {plain / cascaded:.2f}x |")
    if args.no_step:
        return
    from bench.throughput import profile_step

    llm = LLM(max_num_seqs=64)
    rows = {}
    # the step's prefix is the ~300-token system prompt: forced on
    cascade.MIN_SHARED_TOKENS = cascade.MIN_SHARED_TOKENS_KERNEL = cascade.MIN_SHARED_TOKENS_PLAIN = 0
    for name, minimum in (("per-sequence", 10**9), ("cascade", cascade.MIN_SHARING_ROWS)) * 2:
        cascade.MIN_SHARING_ROWS = minimum
        rows.setdefault(name, []).append(profile_step(llm, 64, 0)["step_ms"])
    print("\n| decode step, batch 64, default model | ms (two alternating runs, best) |")
    print("|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {min(values):.0f} |")
    print(f"cascade / per-sequence: {min(rows['cascade']) / min(rows['per-sequence']):.2f}x step time")


if __name__ == "__main__":
    main()
