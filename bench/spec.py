"""Prompt-lookup speculative decoding against plain decoding, on the customer-service workload, in one
process: the same model loaded twice (speculation off / on), each concurrency driven against each
in turn, rounds interleaved, so the box's drift hits both alike.

    python -m bench.spec                                  # concurrency 1, 8, 32, 64; 2 rounds
    python -m bench.spec --concurrency 32 64 --always     # draft at every batch size (where does it stop paying?)

Prints generated tok/s of each, the ratio (on / off) per round, TTFT p50, the share of draft tokens
kept, and whether both produced the same replies (greedy: they must).
"""
from __future__ import annotations

import json
import platform

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)

from bench.throughput import interleaved_parser, run_pagedchat
from engine import LLM


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = interleaved_parser(__doc__)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--always", action="store_true", help="draft whatever the batch size (disable_by_batch_size off)")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.always:
        spec["disable_by_batch_size"] = 10**6
    off = LLM(args.model)
    on = LLM(args.model, speculative_config=spec)
    print(f"CPU: {cpu_name()}; model {off.engine.source.name}, {off.engine.quantization_shown}; spec {json.dumps(spec)}")
    print("| sessions | off tok/s | on tok/s | ratio (rounds) | TTFT p50 off / on | draft tokens kept | same replies |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        rows = {"off": [], "on": []}
        before = on.engine.get_stats()
        same = True
        for _ in range(args.rounds):
            for name, llm in (("off", off), ("on", on)):
                rows[name].append(run_pagedchat(llm, c, args.turns, args.seed))
            same &= rows["off"][-1]["replies"] == rows["on"][-1]["replies"]
        after = on.engine.get_stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        kept = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in rows.items()}
        ratios = " / ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(rows["off"], rows["on"]))
        ttft = {k: sorted(r["ttft_p50"] for r in v)[len(v) // 2] * 1000 for k, v in rows.items()}
        print(f"| {c} | {tok['off']:.1f} | {tok['on']:.1f} | {tok['on'] / tok['off']:.2f}x ({ratios}) | "
              f"{ttft['off']:.0f} / {ttft['on']:.0f} ms | {kept}/{drafted} ({kept / max(drafted, 1):.0%}) | "
              f"{'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
