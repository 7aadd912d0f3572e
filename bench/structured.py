"""What a constrained request costs a shared decode step (structured outputs as token bitmasks).

    python -m bench.structured                 # batch 16: all free, half constrained, all constrained

Each run decodes a batch of B requests for `--tokens` steps (greedy). Constrained requests follow a
grammar that cannot end before the last step, so every step of the run has the whole batch: a long
regex; tool calling in `auto` (free text that may start a call: every step is masked); and a
`required` call whose argument is a long string. Prints the mean decode-step time and its ratio to
the all-free batch, run first in the same process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.tools import parse_tools

LONG_TEXT = StructuredOutputsParams(regex="[A-Za-z ,.]{400}")
NOTE = [{"type": "function", "function": {"name": "add_note", "parameters": {
    "type": "object", "properties": {"note": {"type": "string", "minLength": 2000}}, "required": ["note"]}}}]
TOOLS_AUTO = StructuredOutputsParams(grammar=parse_tools(NOTE, "auto").grammar)
TOOLS_REQUIRED = StructuredOutputsParams(grammar=parse_tools(NOTE, "required").grammar)


def run(llm: LLM, batch: int, constrained: int, tokens: int, spec: StructuredOutputsParams = LONG_TEXT) -> float:
    eng = llm.engine
    prompt = llm.render_chat([{"role": "user", "content": "Describe our return policy in detail."}])
    for i in range(batch):
        row = spec if i < constrained else None
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=row is None,
                                               min_tokens=tokens, structured_outputs=row), request_id=f"r{i}")
    steps = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        if eng.stats.last_decode_tokens == batch:
            steps.append(time.perf_counter() - t0)
    return statistics.mean(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=max(args.batch, 16))
    run(llm, 2, 1, 4)  # warm-up (and llguidance's tokenizer view)
    free = run(llm, args.batch, 0, args.tokens)
    print(f"batch {args.batch}, {args.tokens} decode steps each, greedy")
    print("| constrained rows | mean decode step | vs all free |")
    print("|---|---|---|")
    print(f"| 0 | {free * 1000:.1f} ms | 1.00x |")
    for constrained in (args.batch // 2, args.batch):
        t = run(llm, args.batch, constrained, args.tokens)
        print(f"| {constrained} (regex) | {t * 1000:.1f} ms | {t / free:.2f}x |")
    for label, spec in (("tools, auto", TOOLS_AUTO), ("tools, required", TOOLS_REQUIRED)):
        t = run(llm, args.batch, args.batch, args.tokens, spec)
        print(f"| {args.batch} ({label}) | {t * 1000:.1f} ms | {t / free:.2f}x |")


if __name__ == "__main__":
    main()
