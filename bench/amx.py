"""AMX tiles against VNNI tiles for the int8-row kernels, in one process on one loaded model: each layer
shape timed both ways per row count, then the customer-service workload with every kernel's `amx_from`
as measured at load against 0 (VNNI only), rounds interleaved so the box's drift hits both alike.

    python -m bench.amx                                   # concurrency 1, 8, 32, 64; 2 rounds
    python -m bench.amx --concurrency 32 64 --rounds 3
    python -m bench.amx --bf16-tiles                      # the workload: batch_invariant off against on

With --bf16-tiles the workload compares the default (every row on int8 rows, AMX tiles as measured) with
batch_invariant off (4-bit layers on bf16 tiles from the row counts measured at load): their replies may
differ (other rounding).

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
from engine.quant.kernels import Int4Weight, QuantizedWeight


def int8_row_kernels(llm: LLM) -> list[QuantizedWeight]:
    kernels = [m.kernel for m in llm.engine.model.modules() if isinstance(m, Linear)]
    return [k for k in kernels if isinstance(k, QuantizedWeight) and shape_key(k) is not None]


def layer_table(kernels: list[QuantizedWeight], rows=(1, 16, 32, 64, 128, 256, 512), repeats: int = 7) -> None:
    """ms per call of each layer shape: int8 rows on VNNI and on AMX tiles, and (4-bit layers, where
    the CPU has AMX-BF16) bf16 tiles."""
    print("| layer | rows | VNNI ms | AMX ms | VNNI / AMX | bf16 tiles ms | AMX / bf16 tiles |")
    print("|---|---|---|---|---|---|---|")
    seen = set()
    for kernel in kernels:
        key = shape_key(kernel)
        if key in seen:
            continue
        seen.add(key)
        chosen = kernel.amx_from
        for m in rows:
            x = torch.randn(m, kernel.K).to(torch.bfloat16)
            calls = max(1, int(0.01 / _seconds(kernel._packed_matmul, x, 1)))
            tiles = isinstance(kernel, Int4Weight) and cpu_kernels.has("amx_bf16_tiles")
            best = {0: float("inf"), 1: float("inf"), "bf16": float("inf") if tiles else None}
            for _ in range(repeats):
                for amx_from in (0, 1):
                    kernel.amx_from = amx_from
                    best[amx_from] = min(best[amx_from], _seconds(kernel._packed_matmul, x, calls) / calls)
                if tiles:
                    best["bf16"] = min(best["bf16"], _seconds(kernel._tiles_matmul, x, calls) / calls)
            bf16 = f"{best['bf16'] * 1e3:.3f} | {best[1] / best['bf16']:.2f}x" if tiles else "- | -"
            print(f"| {key} | {m} | {best[0] * 1e3:.3f} | {best[1] * 1e3:.3f} | {best[0] / best[1]:.2f}x | {bf16} |")
        kernel.amx_from = chosen


def main() -> None:
    ap = interleaved_parser(__doc__)
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer table")
    ap.add_argument("--bf16-tiles", action="store_true", help="the workload with batch_invariant off against on")
    args = ap.parse_args()
    llm = LLM(args.model, batch_invariant=not args.bf16_tiles)
    kernels = int8_row_kernels(llm)
    if not cpu_kernels.has("amx_tiles") or not kernels:
        raise SystemExit("no AMX tiles here (the CPU lacks AMX-INT8, Linux does not lend it, "
                         "or no layer has int8 rows)")
    measured = {id(k): (k.amx_from, k.tiles_from) for k in kernels}
    print(f"CPU: {cpu_name()}; model {llm.engine.source.name}, {llm.engine.quantization_shown}; "
          f"{cpu_kernels.threads()} threads; AMX from {sorted({shape_key(k): k.amx_from for k in kernels}.items())}")
    if not args.no_layers:
        layer_table(kernels)

    def use_amx(on: bool) -> None:  # the second way: AMX tiles, or with --bf16-tiles bf16 tiles too
        for k in kernels:
            amx_from, tiles_from = measured[id(k)]
            k.amx_from, k.tiles_from = (amx_from if on or args.bf16_tiles else 0), (tiles_from if on else 0)

    names = ("invariant", "bf16 tiles") if args.bf16_tiles else ("VNNI", "AMX")
    print(f"\n| sessions | {names[0]} tok/s | {names[1]} tok/s | ratio (rounds) | TTFT p50 {names[0]} / {names[1]} "
          f"| same replies |")
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
