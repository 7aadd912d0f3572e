"""What isolating the prefix cache per user costs (`--cache-isolation user`, or `cache_salt` on the API).

    python -m bench.cache_isolation                  # 16 users, 3 turns, 8 at a time

The same customer-service sessions run twice in one process on the same engine: shared (every user
reuses the cached system prompt) and salted (each user's turns carry their own salt, so each user
computes the system prompt once for themselves). Prints prompt tokens computed, prefix-cache hit
rate, TTFT p50/p95 and generated tok/s, with the salted run's ratios to the shared one.
"""
from __future__ import annotations

import argparse
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from bench.throughput import MAX_TOKENS, Session, _pct
from engine import LLM, SamplingParams


def run(llm: LLM, users: int, concurrency: int, turns: int, salted: bool) -> dict:
    eng = llm.engine
    llm.reset_prefix_cache()
    before = eng.get_stats()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    sessions = {str(i): Session(i, turns, seed=0) for i in range(users)}
    waiting, turn_no = list(sessions), dict.fromkeys(sessions, 0)
    ttfts, generated = [], 0

    def submit(sid: str) -> None:
        msgs = sessions[sid].next_messages()
        if msgs is not None:
            turn_no[sid] += 1
            eng.add_request(llm.render_chat(msgs), params, request_id=f"{sid}-{turn_no[sid]}",
                            cache_salt=f"user:{sid}" if salted else None)

    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit(waiting.pop(0))
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                sid = out.request_id.split("-")[0]
                generated += len(out.outputs[0].token_ids)
                ttfts.append(out.metrics.time_to_first_token)
                sessions[sid].add_reply(out.outputs[0].text)
                if sessions[sid].pending:
                    submit(sid)
                elif waiting:
                    submit(waiting.pop(0))  # a user finished: the next one starts their chat
    seconds = time.perf_counter() - t0
    after = eng.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return dict(computed=queries - hits, hit_rate=hits / max(queries, 1), ttft_p50=_pct(ttfts, 50),
                ttft_p95=_pct(ttfts, 95), tok_s=generated / seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=64)
    run(llm, 2, 2, 1, salted=False)  # warm-up
    shared = run(llm, args.users, args.concurrency, args.turns, salted=False)
    salted = run(llm, args.users, args.concurrency, args.turns, salted=True)
    print(f"{args.users} users x {args.turns} turns, {args.concurrency} at a time, greedy, max_tokens {MAX_TOKENS}")
    print("| cache | prompt tokens computed | hit rate | TTFT p50 | TTFT p95 | gen tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in (("shared", shared), ("per user", salted)):
        print(f"| {name} | {r['computed']} | {r['hit_rate']:.0%} | {r['ttft_p50'] * 1000:.0f} ms | "
              f"{r['ttft_p95'] * 1000:.0f} ms | {r['tok_s']:.1f} |")
    print(f"per user / shared: {salted['computed'] / shared['computed']:.2f}x tokens computed, "
          f"TTFT p50 {salted['ttft_p50'] / shared['ttft_p50']:.2f}x, tok/s {salted['tok_s'] / shared['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
