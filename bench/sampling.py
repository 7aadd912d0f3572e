"""What sampling costs: top-p drawn from each row's shortlist (engine/nucleus.py) against the sort of
the whole vocabulary and the exponential race over it that the sampler used before, on real logits
of the default model; the chat's repetition penalty on the batch at once (engine/penalties.py)
against row by row; and the engine's generated tok/s sampled as the chat samples (the model card's
temperature 0.2 and top_p 0.9, the chat's repetition_penalty 1.1) against greedy.

    python -m bench.sampling [--batch 1 8 32 64] [--concurrency 1 8 32 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from engine import LLM, SamplingParams, nucleus
from engine.penalties import apply_penalties
from engine.request import Request
from engine.sampler import Sampler
from ui.assistants import CHAT_REPETITION_PENALTY
from ui.simulate import CUSTOMER_SERVICE_PROMPT, user_turns

CARD = dict(temperature=0.2, top_p=0.9)
CHAT = dict(CARD, repetition_penalty=CHAT_REPETITION_PENALTY)


def reply_logits(llm: LLM, chats: int) -> torch.Tensor:
    """The logits at every position of greedy replies to customer-service chats: the distributions a
    decode step samples from."""
    from engine.outputs import ScheduledRequest

    rows = []
    for i in range(chats):
        prompt = llm.render_chat([{"role": "system", "content": CUSTOMER_SERVICE_PROMPT},
                                  {"role": "user", "content": user_turns(i, 1)[0]}])
        reply = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].token_ids
        ids = prompt + list(reply)
        req = Request(f"logits-{i}", ids, SamplingParams())
        assert llm.engine.kv.allocate_slots(req, len(ids))
        try:
            logits = llm.engine.runner.logits_for_all(ScheduledRequest(req, len(ids), llm.engine.kv.block_ids(req.request_id)))
        finally:
            llm.engine.kv.free(req)
        rows.append(logits[len(prompt) - 1:-1].float())
    return torch.cat(rows)


def sorted_race(sampler: Sampler, logits: torch.Tensor, params) -> torch.Tensor:
    """The baseline: filters over the whole sorted vocabulary, then an exponential race over all of it."""
    probs = nucleus.filtered_by_sort(logits, params).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=sampler.generator)
    return (probs / noise).argmax(dim=-1)


def penalty_row_by_row(logits: torch.Tensor, requests: list[Request]) -> None:
    """The baseline: the repetition penalty one row at a time, over the set of the row's whole context."""
    for row, req in zip(logits, requests):
        seen = torch.tensor(sorted(set(req.all_token_ids)))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / req.params.repetition_penalty, values * req.params.repetition_penalty)


def penalty_table(llm: LLM, logits: torch.Tensor, batches: list[int], repeats: int) -> None:
    """The chat's repetition penalty on rows whose context is a customer-service chat (system prompt,
    question, a reply under way): row by row against engine/penalties.py's one gather / scatter."""
    print("\n| rows | context tokens | penalty row by row (ms) | batched (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for b in batches:
        requests = []
        for i in range(b):
            prompt = llm.render_chat([{"role": "system", "content": CUSTOMER_SERVICE_PROMPT},
                                      {"role": "user", "content": user_turns(i, 1)[0]}])
            req = Request(f"penalty-{i}", prompt, SamplingParams(**CHAT))
            for t in prompt[-40:]:  # a reply under way that repeats some of its context
                req.append_output_token(t)
            requests.append(req)
        x = logits[torch.arange(b) % len(logits)]
        base = best_ms(lambda: penalty_row_by_row(x.clone(), requests), repeats)
        ours = best_ms(lambda: apply_penalties(x.clone(), requests), repeats)
        tokens = statistics.mean(r.num_tokens for r in requests)
        print(f"| {b} | {tokens:.0f} | {base:.2f} | {ours:.2f} | {base / ours:.1f}x |")


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def sampler_table(logits: torch.Tensor, batches: list[int], repeats: int) -> None:
    print("| rows | whole vocabulary sorted, exponential race (ms) | shortlist, inverse CDF (ms) | speed-up | rows decided in the shortlist |")
    print("|---|---|---|---|---|")
    sampler = Sampler(0, torch.device("cpu"))
    for b in batches:
        x = logits[torch.arange(b) % len(logits)] / CARD["temperature"]
        params = [SamplingParams(**CARD)] * b
        reqs = [Request(str(i), [1], p) for i, p in enumerate(params)]
        base = best_ms(lambda: sorted_race(sampler, x, params), repeats)
        ours = best_ms(lambda: sampler._draw(x, reqs), repeats)
        decided = len(nucleus.shortlist(x, params).rows)
        print(f"| {b} | {base:.2f} | {ours:.2f} | {base / ours:.1f}x | {decided}/{b} |")


def engine_table(llm: LLM, concurrency: list[int], rounds: int) -> None:
    print("\n| sessions | greedy tok/s | as the chat samples, tok/s | sampled / greedy (rounds) |")
    print("|---|---|---|---|")
    for c in concurrency:
        prompts = [llm.render_chat([{"role": "system", "content": CUSTOMER_SERVICE_PROMPT},
                                    {"role": "user", "content": user_turns(i, 1)[0]}]) for i in range(c)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))  # the prompts in the prefix cache
        rates: dict[str, list[float]] = {"greedy": [], "chat": []}
        for r in range(rounds):
            order = ("greedy", "chat") if r % 2 == 0 else ("chat", "greedy")
            for name in order:
                extra = {"temperature": 0} if name == "greedy" else CHAT  # unseeded, as in the chat (a seeded request does not draft)
                params = SamplingParams(max_tokens=64, ignore_eos=True, **extra)
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        ratios = " / ".join(f"{s / g:.2f}" for s, g in zip(rates["chat"], rates["greedy"]))
        g, s = statistics.median(rates["greedy"]), statistics.median(rates["chat"])
        print(f"| {c} | {g:.1f} | {s:.1f} | {s / g:.2f}x ({ratios}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    llm = LLM(num_kv_blocks=4096)
    logits = reply_logits(llm, 4)
    sampler_table(logits, args.batch, args.repeats)
    penalty_table(llm, logits, args.batch, args.repeats)
    engine_table(llm, args.concurrency, args.rounds)


if __name__ == "__main__":
    main()
