"""What the KV disk tier (`--kv-disk`) buys and costs, in one process on the default model.

    python -m bench.kv_disk                        # ~1,500-token session; 32 chats x 3 turns

1. A returning session after a restart: a customer-service chat grown to ~1,500 tokens, the engine
   closed and started again, then the next turn. TTFT with the tier (the history is read back from
   disk) against a fresh engine without it (the history is prefilled again). `--trials` times each,
   alternating; each trial is a new engine.
2. Steady state: bench/throughput.py's workload with the tier on and off (alternating runs, a pool
   large enough that nothing is evicted, so the tier only pays its write-behind copies).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from bench.throughput import Session, run_pagedchat
from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)


def grow_session(llm: LLM, target_tokens: int) -> tuple[list[dict], int]:
    """Turns of one simulated customer until the history passes `target_tokens`."""
    session = Session(0, 40, seed=0)
    while True:
        ids = llm.render_chat(session.next_messages())
        out = llm.generate([ids], GREEDY)[0]
        session.add_reply(out.outputs[0].text)
        if len(ids) + len(out.outputs[0].token_ids) >= target_tokens or not session.pending:
            session.messages.append({"role": "user", "content": session.pending.pop(0)})
            return session.messages, len(llm.render_chat(session.messages))


def first_token(llm: LLM, messages: list[dict]) -> tuple[float, int]:
    ids = llm.render_chat(messages)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    return out.metrics.time_to_first_token, out.num_cached_tokens


def restart(folder: str, target: int, trials: int, model: str | None) -> None:
    llm = LLM(model, kv_disk=folder)
    messages, prompt_tokens = grow_session(llm, target)
    llm.engine.close()  # a deploy: the process ends, its queued writes land
    del llm
    with_tier, without = [], []
    for _ in range(trials):
        for disk, into in ((folder, with_tier), (None, without)):
            t0 = time.perf_counter()
            fresh = LLM(model, kv_disk=disk)
            load = time.perf_counter() - t0
            ttft, cached = first_token(fresh, messages)
            into.append((ttft, cached, load))
            fresh.engine.close()
    on, off = statistics.median(t for t, _, _ in with_tier), statistics.median(t for t, _, _ in without)
    print(f"\nreturning session after a restart: {prompt_tokens}-token prompt, {trials} trials each")
    print("| after restart | TTFT p50 | cached tokens | engine start |")
    print("|---|---|---|---|")
    for name, rows, t in (("disk tier", with_tier, on), ("recompute", without, off)):
        print(f"| {name} | {t * 1000:.0f} ms | {rows[0][1]} | {statistics.median(r[2] for r in rows):.1f} s |")
    print(f"disk tier / recompute: TTFT {on / off:.2f}x (aim: at most 0.25x)")


def steady_state(folder: str, concurrency: int, turns: int, rounds: int, model: str | None) -> None:
    engines = {"off": LLM(model, max_num_seqs=64), "on": LLM(model, max_num_seqs=64, kv_disk=folder)}
    for llm in engines.values():
        run_pagedchat(llm, 2, 1, 0)  # warm-up
    runs = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            runs[name].append(run_pagedchat(llm, concurrency, turns, 0))
    stats = engines["on"].get_stats()
    tok_s = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
    print(f"\nsteady state: {concurrency} chats x {turns} turns, {rounds} alternating rounds each")
    print("| disk tier | gen tok/s (median) | TTFT p50 |")
    print("|---|---|---|")
    for name, rs in runs.items():
        print(f"| {name} | {tok_s[name]:.1f} | {statistics.median(r['ttft_p50'] for r in rs) * 1000:.0f} ms |")
    print(f"on / off: {tok_s['on'] / tok_s['off']:.3f}x tok/s (aim: at least 0.95x); the tier wrote "
          f"{stats.kv_disk_written_bytes / 2**20:.0f} MiB, dropped {stats.kv_disk_dropped_writes} writes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--history-tokens", type=int, default=1500)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--skip-steady-state", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedchat-kv-") as folder:
        restart(folder, args.history_tokens, args.trials, args.model)
        if not args.skip_steady_state:
            steady_state(folder, args.concurrency, args.turns, args.rounds, args.model)


if __name__ == "__main__":
    main()
