"""AMX tiles against VNNI tiles for the int8-row kernels, in one process on one loaded model: each layer
shape timed both ways per row count, then the customer-service workload with every kernel's `amx_from`
as measured at load against 0 (VNNI only), rounds interleaved so the box's drift hits both alike.

    python -m bench.amx                                   # concurrency 1, 8, 32, 64; 2 rounds
    python -m bench.amx --concurrency 32 64 --rounds 3

Prints ms per call and the ratio per layer shape, then generated tok/s of each, the ratio (AMX / VNNI)
per round, TTFT p50, and whether both produced the same replies (they must: the tiles are bit-identical).
"""
from __future__ import annotations


import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.spec import cpu_name
from bench.throughput import interleaved_parser, run_pagedchat
from engine import LLM, cpu_kernels
from engine.linear import Linear
from engine.quant.choose import _seconds, shape_key
from engine.quant.kernels import QuantizedWeight


def int8_row_kernels(llm: LLM) -> list[QuantizedWeight]:
    kernels = [m.kernel for m in llm.engine.model.modules() if isinstance(m, Linear)]
    return [k for k in kernels if isinstance(k, QuantizedWeight) and shape_key(k) is not None]


def layer_table(kernels: list[QuantizedWeight], rows=(1, 16, 32, 64, 128, 256), repeats: int = 7) -> None:
    print("| layer | rows | VNNI ms | AMX ms | VNNI / AMX |")
    print("|---|---|---|---|---|")
    seen = set()
    for kernel in kernels:
        key = shape_key(kernel)
        if key in seen:
            continue
        seen.add(key)
        chosen = kernel.amx_from
        for m in rows:
            x = torch.randn(m, kernel.K).to(torch.bfloat16)
            calls = max(1, int(0.01 / _seconds(kernel, x, 1)))
            best = {0: float("inf"), 1: float("inf")}
            for _ in range(repeats):
                for amx_from in best:
                    kernel.amx_from = amx_from
                    best[amx_from] = min(best[amx_from], _seconds(kernel, x, calls) / calls)
            print(f"| {key} | {m} | {best[0] * 1e3:.3f} | {best[1] * 1e3:.3f} | {best[0] / best[1]:.2f}x |")
        kernel.amx_from = chosen


def main() -> None:
    ap = interleaved_parser(__doc__)
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer table")
    args = ap.parse_args()
    llm = LLM(args.model)
    kernels = int8_row_kernels(llm)
    if not cpu_kernels.has("amx_tiles") or not kernels:
        raise SystemExit("no AMX tiles here (the CPU lacks AMX-INT8, Linux does not lend it, "
                         "or no layer has int8 rows)")
    measured = {id(k): k.amx_from for k in kernels}
    print(f"CPU: {cpu_name()}; model {llm.engine.source.name}, {llm.engine.quantization_shown}; "
          f"{cpu_kernels.threads()} threads; AMX from {sorted({shape_key(k): k.amx_from for k in kernels}.items())}")
    if not args.no_layers:
        layer_table(kernels)

    def use_amx(on: bool) -> None:
        for k in kernels:
            k.amx_from = measured[id(k)] if on else 0

    print("\n| sessions | VNNI tok/s | AMX tok/s | ratio (rounds) | TTFT p50 VNNI / AMX | same replies |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        rows = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                use_amx(on)
                rows[on].append(run_pagedchat(llm, c, args.turns, args.seed))
        same = all(a["replies"] == b["replies"] for a, b in zip(rows[False], rows[True]))
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in rows.items()}
        ratios = " / ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(rows[False], rows[True]))
        ttft = {k: sorted(r["ttft_p50"] for r in v)[len(v) // 2] * 1e3 for k, v in rows.items()}
        print(f"| {c} | {tok[False]:.1f} | {tok[True]:.1f} | {tok[True] / tok[False]:.2f}x ({ratios}) | "
              f"{ttft[False]:.0f} / {ttft[True]:.0f} ms | {'yes' if same else 'NO'} |")
    use_amx(True)


if __name__ == "__main__":
    main()
