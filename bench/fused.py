"""The decoder stack as one C call (engine/fused_layers.py) against the same layers module by module, on
the customer-service workload, in one process and on one engine (two instances of the same model
differed 7-13% here): the fused stack switched off and on run by run, rounds interleaved.

    python -m bench.fused                          # concurrency 1, 8, 32, 64; 2 rounds

Prints generated tok/s of each, the ratio (fused / modules) per round, TTFT p50, and whether both
produced the same replies (the same bits: they must).
"""
from __future__ import annotations

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)

from bench.spec import cpu_name
from bench.throughput import interleaved_parser, run_pagedchat
from engine import LLM


def main() -> None:
    args = interleaved_parser(__doc__).parse_args()
    llm = LLM(args.model)
    model = llm.engine.model.model
    fused = getattr(model, "fused", None)
    if fused is None:
        raise SystemExit("this model (or PAGEDCHAT_NO_FUSED_LAYERS) runs no fused stack: nothing to compare")
    print(f"CPU: {cpu_name()}; model {llm.engine.source.name}, {llm.engine.quantization_shown}")
    print("| sessions | modules tok/s | fused tok/s | ratio (rounds) | TTFT p50 modules / fused | same replies |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        rows, same = {"modules": [], "fused": []}, True
        for _ in range(args.rounds):
            for name, stack in (("modules", None), ("fused", fused)):
                model.fused = stack
                rows[name].append(run_pagedchat(llm, c, args.turns, args.seed))
            same &= rows["modules"][-1]["replies"] == rows["fused"][-1]["replies"]
        model.fused = fused
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in rows.items()}
        ratios = " / ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(rows["modules"], rows["fused"]))
        ttft = {k: sorted(r["ttft_p50"] for r in v)[len(v) // 2] * 1000 for k, v in rows.items()}
        print(f"| {c} | {tok['modules']:.1f} | {tok['fused']:.1f} | {tok['fused'] / tok['modules']:.2f}x ({ratios}) | "
              f"{ttft['modules']:.0f} / {ttft['fused']:.0f} ms | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
