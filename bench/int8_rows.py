"""What rounding decode rows to int8 per 32 inputs (EngineConfig.int8_activations) costs and buys, on
the default model in one process: the 4-bit matmuls of one layer at 1-64 rows (bf16 rows vs int8 rows,
median ms and ratio), mean NLL with every row through the packed kernels (4-bit layers, 8-bit LM
head), and greedy agreement on
customer-service chats (tokens until the first difference against bf16 rows; fp32 against bf16 rows
is the scale: how far plain rounding differences already move a greedy reply).

    python -m bench.int8_rows [--chats 16]
"""
from __future__ import annotations

import argparse
import statistics

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from bench.quant import PASSAGE, _median_us
from engine import LLM, SamplingParams, cpu_kernels
from engine.quant import kernels
from ui.simulate import CUSTOMER_SERVICE_PROMPT, user_turns


def layer_times(llm: LLM, rows=(1, 8, 32, 64)) -> list[tuple[int, float, float]]:
    """Median ms of layer 0's 4-bit matmuls by row count: bf16 rows, int8 rows."""
    layer = llm.engine.model.model.layers[0]
    weights = [m.kernel for m in layer.modules() if isinstance(getattr(m, "kernel", None), kernels.Int4Weight)]
    out = []
    for m in rows:
        xs = [torch.randn(m, w.K).bfloat16() for w in weights]
        times = []
        for int8 in (False, True):
            run = [lambda w=w, x=x: cpu_kernels.int4_matmul(x, w.packed, w.scales_and_zeros, w.group_size, int8)
                   for w, x in zip(weights, xs)]
            times.append(_median_us(lambda: [f() for f in run]) / 1000)
        out.append((m, *times))
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per reply: tokens equal before the first difference."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=16)
    args = p.parse_args()
    llm = LLM(dtype="bfloat16")
    if not kernels.int8_rows_in_use(llm.engine.model):
        raise SystemExit("int8 rows need our kernels with AVX-512 BF16 and VNNI: not on this CPU")
    print("| rows | bf16 rows ms | int8 rows ms | ratio |\n|---|---|---|---|")
    for m, bf16, int8 in layer_times(llm):
        print(f"| {m} | {bf16:.3f} | {int8:.3f} | {bf16 / int8:.2f}x |")
    chats = [[{"role": "system", "content": CUSTOMER_SERVICE_PROMPT},
              {"role": "user", "content": user_turns(i, 1)[0]}] for i in range(args.chats)]
    params = SamplingParams(temperature=0, max_tokens=64)
    ids = llm.get_tokenizer().encode(open(PASSAGE).read())
    del llm
    every_row = kernels.packed_rows
    replies, nll = {}, {}
    for int8 in (False, True):
        llm = LLM(dtype="bfloat16", int8_activations=int8)
        replies[int8] = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
        kernels.packed_rows = lambda rows, limit, all_rows=0: rows  # score the passage through the packed kernels
        nll[int8] = llm.mean_nll(ids)
        kernels.packed_rows = every_row
        del llm
    fp32 = [o.outputs[0].token_ids for o in LLM(dtype="float32").chat(chats, params)]
    print(f"\nmean NLL, {len(ids)} tokens, every row packed: bf16 rows {nll[False]:.4f}, int8 rows {nll[True]:.4f} "
          f"({nll[True] / nll[False] - 1:+.2%})")
    for name, other in (("int8 rows", replies[True]), ("fp32 model", fp32)):
        agree = agreement(other, replies[False])
        same = sum(x == y for x, y in zip(other, replies[False]))
        print(f"{name} vs bf16 rows, {len(chats)} greedy replies of up to 64 tokens: identical {same}, "
              f"tokens before the first difference median {statistics.median(agree):.0f} (min {min(agree)})")


if __name__ == "__main__":
    main()
