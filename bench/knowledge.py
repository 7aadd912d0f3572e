"""How much of the knowledge a turn carries is served from the prefix cache, with the chunks laid
on KV block boundaries (ui/grounding.py) and without (the same text, no padding, one encode).

    python -m bench.knowledge                 # 32 chats about the 4 articles of docs/knowledge

Each chat is a customer's first turn: the assistant's system prompt, the chunks retrieved for its
question (FTS5 over docs/knowledge), the question; one token is generated (TTFT = the prefill).
Chats ask about a handful of articles in varied words, so many cite chunks an earlier chat cited.
For every chat whose chunk set was seen before, the share of its knowledge tokens that came from
the cache; and the mean TTFT over all chats. The two layouts run interleaved in one process, the
prefix cache reset before each pass, so their ratio is fair on this machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from engine import LLM, SamplingParams
from storage import Store
from storage.knowledge import Knowledge
from ui.grounding import ground
from ui.simulate import CUSTOMER_SERVICE_PROMPT

FOLDER = os.path.join(os.path.dirname(__file__), "..", "docs", "knowledge")
QUESTIONS = ["How long do refunds take?", "When will I get my refund back?", "Can I return a worn jacket?",
             "How do I return unused boots?", "How long does standard shipping take?", "Is express shipping fast?",
             "My tracking has not changed for days", "Can I change my delivery address?",
             "Does the warranty cover a broken tent pole?", "Is fire damage covered by the warranty?",
             "How do I make a warranty claim?", "반품 가능한가요?", "환불은 언제 되나요?",
             "What does the warranty cover on backpacks?", "How much is express shipping?",
             "Do you refund shipping costs?"]


def run_pass(llm: LLM, kb: Knowledge, chats: int, align: bool) -> dict:
    tok, block = llm.get_tokenizer(), llm.engine.config.block_size
    llm.reset_prefix_cache()
    seen, shares, ttfts = set(), [], []
    for i in range(chats):
        question = QUESTIONS[(i * 7) % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (chat {i})")
        chunks = kb.search("support", question, k=3)
        g = ground(tok, CUSTOMER_SERVICE_PROMPT, chunks, block, align=align)
        text = tok.apply_chat_template([{"role": "system", "content": CUSTOMER_SERVICE_PROMPT + g.text},
                                        {"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        ids = g.encode(tok, text) if align else tok.encode(text, add_special_tokens=False)
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
        ttfts.append(out.metrics.time_to_first_token)
        key = tuple(c.id for c in g.chunks)
        if key and key in seen:
            spans = g.spans if align else _spans(tok, ids, g)
            total = sum(e - s for s, e in spans)
            cached = sum(max(0, min(e, out.num_cached_tokens) - s) for s, e in spans)
            shares.append(cached / total)
        seen.add(key)
    return {"share": statistics.mean(shares) if shares else float("nan"), "repeats": len(shares),
            "ttft": statistics.mean(ttfts)}


def _spans(tok, ids: list[int], g) -> list[tuple[int, int]]:
    """The knowledge's token range in an unaligned prompt (one encode: no exact chunk boundaries)."""
    head = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": CUSTOMER_SERVICE_PROMPT + "\x00"}],
                                                  tokenize=False).split("\x00")[0], add_special_tokens=False))
    return [(head, head + len(tok.encode(g.text, add_special_tokens=False)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    kb = Knowledge(Store(os.path.join(tempfile.mkdtemp(), "bench.db")))
    print("\n".join(kb.add_folder("support", FOLDER)))
    llm = LLM(args.model, num_kv_blocks=2048)
    run_pass(llm, kb, 4, True)  # warm-up
    results = {True: [], False: []}
    for _ in range(args.rounds):
        for align in (False, True):
            results[align].append(run_pass(llm, kb, args.chats, align))
    print(f"{args.chats} chats a pass, {args.rounds} passes a layout, block size {llm.engine.config.block_size}")
    print("| layout | knowledge tokens from the cache (repeat citations) | mean TTFT | vs unaligned |")
    print("|---|---|---|---|")
    base = statistics.mean(r["ttft"] for r in results[False])
    for align in (False, True):
        share = statistics.mean(r["share"] for r in results[align])
        ttft = statistics.mean(r["ttft"] for r in results[align])
        print(f"| {'block-aligned' if align else 'unaligned'} | {share:.1%} ({results[align][0]['repeats']} chats) | "
              f"{ttft * 1000:.0f} ms | {ttft / base:.2f}x |")


if __name__ == "__main__":
    main()
