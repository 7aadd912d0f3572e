"""--kv-cache-dtype int8 against the model's own dtype, in one process on the same model: quality (mean NLL
of a passage the repo never calibrates on; greedy replies of the customer-service workload compared
token by token), KV blocks in the same memory, the disk tier's bytes per block, and generated tok/s,
each concurrency driven against each in turn, rounds interleaved.

    python -m bench.kv_int8                               # concurrency 1, 8, 32, 64; 2 rounds
    python -m bench.kv_int8 --concurrency 32 64 --rounds 3
"""
from __future__ import annotations

import os
import statistics

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)

from bench.spec import cpu_name
from bench.throughput import interleaved_parser, run_pagedchat
from engine import LLM

PASSAGE = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "eval_passage.txt")


def agreement(a: dict, b: dict) -> tuple[float, float]:
    """(share of replies identical, median tokens before the first difference) over the same requests."""
    firsts = [next((i for i, (s, t) in enumerate(zip(x, b[rid])) if s != t), min(len(x), len(b[rid])))
              for rid, x in a.items()]
    return sum(x == b[rid] for rid, x in a.items()) / len(a), statistics.median(firsts)


def main() -> None:
    ap = interleaved_parser(__doc__)
    args = ap.parse_args()
    llms = {kv: LLM(args.model, kv_cache_dtype=kv) for kv in ("auto", "int8")}
    base = llms["auto"].engine
    print(f"CPU: {cpu_name()}; model {base.source.name}, {base.quantization_shown}, {base.dtype}")
    ids = llms["auto"].get_tokenizer().encode(open(PASSAGE).read())
    for kv, llm in llms.items():
        e = llm.engine
        block = e.runner.read_block(0)
        print(f"KV {kv}: mean NLL {llm.mean_nll(ids):.4f} over {len(ids)} tokens; {e.stats.kv_blocks_total} blocks "
              f"in {e.runner.kv_cache_bytes / 2**20:.0f} MiB; a block on disk {block.numel() * block.element_size()} "
              f"bytes of K/V")
    print("\n| sessions | auto tok/s | int8 tok/s | ratio (rounds) | TTFT p50 auto / int8 | replies identical | "
          "median tokens before the first difference |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        rows = {"auto": [], "int8": []}
        for _ in range(args.rounds):
            for kv, llm in llms.items():
                rows[kv].append(run_pagedchat(llm, c, args.turns, args.seed))
        same, before = agreement(rows["auto"][0]["replies"], rows["int8"][0]["replies"])
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in rows.items()}
        ratios = " / ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(rows["auto"], rows["int8"]))
        ttft = {k: sorted(r["ttft_p50"] for r in v)[len(v) // 2] * 1e3 for k, v in rows.items()}
        print(f"| {c} | {tok['auto']:.1f} | {tok['int8']:.1f} | {tok['int8'] / tok['auto']:.2f}x ({ratios}) | "
              f"{ttft['auto']:.0f} / {ttft['int8']:.0f} ms | {same:.0%} | {before:.0f} |")


if __name__ == "__main__":
    main()
