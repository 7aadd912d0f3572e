"""What rounding rows to int8 per 32 inputs (EngineConfig.int8_activations) costs and buys, on the
default model in one process, the two engines alternating: the 4-bit matmuls of one layer at 1-256 rows
(rows as they are vs int8 rows, ms, the faster of the rounds), mean NLL with every row through the packed
kernels (4-bit layers, 8-bit LM head), greedy agreement on customer-service chats (tokens until the first
difference against rows as they are; the other dtype's model against them is the scale: how far plain
rounding differences already move a greedy reply), and generated tok/s on the customer-service workload.
The model's dtype is the CPU's (bf16 rows on AVX-512 VNNI, fp32 on AVX2).

    python -m bench.int8_rows [--chats 16] [--dtype float32] [--concurrency 8 64] [--rounds 2]
"""
from __future__ import annotations

import statistics

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.quant import PASSAGE, _median_us
from bench.spec import cpu_name
from bench.throughput import interleaved_parser, run_pagedchat
from engine import LLM, SamplingParams
from engine.quant import kernels
from ui.simulate import CUSTOMER_SERVICE_PROMPT, user_turns

ROWS = (1, 8, 32, 64, 256)


def layer_time(llm: LLM, rows: int) -> float:
    """Median ms of layer 0's 4-bit matmuls through the model's packed kernels at `rows` rows."""
    layer = llm.engine.model.model.layers[0]
    weights = [m.kernel for m in layer.modules() if isinstance(getattr(m, "kernel", None), kernels.Int4Weight)]
    xs = [torch.randn(rows, w.K).to(llm.engine.dtype) for w in weights]
    return _median_us(lambda: [w._packed_matmul(x) for w, x in zip(weights, xs)], n=20) / 1000


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per reply: tokens equal before the first difference."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]


def main() -> None:
    p = interleaved_parser(__doc__)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: the CPU's)")
    args = p.parse_args()
    llms = {int8: LLM(args.model, dtype=args.dtype, int8_activations=int8) for int8 in (False, True)}
    if not kernels.int8_rows_in_use(llms[True].engine.model):
        raise SystemExit("int8 rows need our kernels (AVX-512 VNNI for bf16 rows, AVX2 for fp32): not here")
    dtype = llms[True].engine.dtype
    print(f"CPU: {cpu_name()}; {dtype} model\n\nlayer 0's 4-bit matmuls\n"
          "| rows | rows as they are ms | int8 rows ms | ratio |\n|---|---|---|---|")
    for m in ROWS:
        rounds = [{int8: layer_time(llm, m) for int8, llm in llms.items()} for _ in range(args.rounds)]
        times = {int8: min(r[int8] for r in rounds) for int8 in llms}
        print(f"| {m} | {times[False]:.3f} | {times[True]:.3f} | {times[False] / times[True]:.2f}x |")
    chats = [[{"role": "system", "content": CUSTOMER_SERVICE_PROMPT},
              {"role": "user", "content": user_turns(i, 1)[0]}] for i in range(args.chats)]
    params = SamplingParams(temperature=0, max_tokens=64)
    ids = llms[True].get_tokenizer().encode(open(PASSAGE).read())
    every_row = kernels.packed_rows
    replies, nll = {}, {}
    for int8, llm in llms.items():
        replies[int8] = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
        kernels.packed_rows = lambda rows, limit, all_rows=0: rows  # score the passage through the packed kernels
        nll[int8] = llm.mean_nll(ids)
        kernels.packed_rows = every_row
    other_dtype = "bfloat16" if dtype == torch.float32 else "float32"
    other = [o.outputs[0].token_ids for o in LLM(args.model, dtype=other_dtype).chat(chats, params)]
    print(f"\nmean NLL, {len(ids)} tokens, every row packed: rows as they are {nll[False]:.4f}, int8 rows "
          f"{nll[True]:.4f} ({nll[True] / nll[False] - 1:+.2%})")
    for name, theirs in (("int8 rows", replies[True]), (f"{other_dtype} model", other)):
        agree = agreement(theirs, replies[False])
        same = sum(x == y for x, y in zip(theirs, replies[False]))
        print(f"{name} vs rows as they are, {len(chats)} greedy replies of up to 64 tokens: identical {same}, "
              f"tokens before the first difference median {statistics.median(agree):.0f} (min {min(agree)})")
    print("\n| sessions | as they are tok/s | int8 rows tok/s | ratio (rounds) | TTFT p50 as they are / int8 |\n"
          "|---|---|---|---|---|")
    for c in args.concurrency:
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for int8, llm in llms.items():
                runs[int8].append(run_pagedchat(llm, c, args.turns, args.seed))
        tok = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in runs.items()}
        ratios = " / ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(runs[False], runs[True]))
        ttft = {k: statistics.median(r["ttft_p50"] for r in v) * 1e3 for k, v in runs.items()}
        print(f"| {c} | {tok[False]:.1f} | {tok[True]:.1f} | {tok[True] / tok[False]:.2f}x ({ratios}) | "
              f"{ttft[False]:.0f} / {ttft[True]:.0f} ms |")


if __name__ == "__main__":
    main()
