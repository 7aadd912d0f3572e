"""What isolating the prefix cache per user costs (`--cache-isolation user`, or `cache_salt` on the API).

    python -m bench.cache_isolation                  # 16 users at once, 3 turns each

The same customer-service sessions (bench/throughput.py's) run twice in one process on the same
engine: shared (every user reuses the cached system prompt) and salted (each user's turns carry their
own salt, so each user computes the system prompt for themselves). Prints prompt tokens computed,
prefix-cache hit rate, TTFT p50/p95 and generated tok/s, with the salted run's ratios to the shared one.
"""
from __future__ import annotations

import argparse

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from bench.throughput import MAX_TOKENS, run_pagedchat
from engine import LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=64)
    run_pagedchat(llm, 2, 1, 0)  # warm-up
    shared = run_pagedchat(llm, args.users, args.turns, 0)
    salted = run_pagedchat(llm, args.users, args.turns, 0, salted=True)
    print(f"{args.users} users at once x {args.turns} turns, greedy, max_tokens {MAX_TOKENS}")
    print("| cache | prompt tokens computed | hit rate | TTFT p50 | TTFT p95 | gen tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in (("shared", shared), ("per user", salted)):
        print(f"| {name} | {r['computed']} | {r['hit_rate']:.0%} | {r['ttft_p50'] * 1000:.0f} ms | "
              f"{r['ttft_p95'] * 1000:.0f} ms | {r['tok_s']:.1f} |")
    print(f"per user / shared: {salted['computed'] / shared['computed']:.2f}x tokens computed, "
          f"TTFT p50 {salted['ttft_p50'] / shared['ttft_p50']:.2f}x, tok/s {salted['tok_s'] / shared['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
