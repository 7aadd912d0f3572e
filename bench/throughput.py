"""Customer-service throughput benchmark: pagedchat against transformers static batching, in one
process, on the same model, dtype and workload; optionally against any OpenAI-compatible server.

    python -m bench.throughput                       # concurrency 1, 8, 32, 64
    python -m bench.throughput --concurrency 32 --no-baseline
    python -m bench.throughput --openai-url http://127.0.0.1:8000/v1 --served-model NAME

Each of C sessions runs `--turns` turns back to back; every turn resends the whole history
(system prompt + earlier turns + replies), greedy, max_tokens 64. Prints generated tokens/s, the
ratio to the baseline, TTFT p50/p95, prefix-cache hit rate and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
import torch

from ui.simulate import CUSTOMER_SERVICE_PROMPT as SYSTEM_PROMPT
from ui.simulate import user_turns
from engine import LLM, SamplingParams, cpu_kernels

MAX_TOKENS = 64
KNOWLEDGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "knowledge")


def use_long_system_prompt() -> None:
    """Every session from now on starts with a shop's long system prompt: ours with the shipped English
    policies (docs/knowledge) pasted in, 1213 tokens of the default model (prompt chunks past 1024 tokens
    of context, a prefix the cascade takes)."""
    global SYSTEM_PROMPT
    policies = "".join(open(os.path.join(KNOWLEDGE, name), encoding="utf-8").read()
                       for name in ("returns.md", "shipping.md", "warranty.md"))
    SYSTEM_PROMPT = f"{SYSTEM_PROMPT}\n\nShop policies:\n{policies}"


class LongSystemPrompt(argparse.Action):
    """--long-system-prompt: use_long_system_prompt() as the options are read (every benchmark's parser)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False,
                         help="the shop's policies pasted into the system prompt (1213 tokens)")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        use_long_system_prompt()
        setattr(namespace, self.dest, True)


class Session:
    def __init__(self, index: int, turns: int, seed: int) -> None:
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.pending = user_turns(index, turns, seed)

    def next_messages(self) -> list[dict] | None:
        if not self.pending:
            return None
        self.messages.append({"role": "user", "content": self.pending.pop(0)})
        return self.messages

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def interleaved_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the in-process A/B benchmarks (bench.spec, bench.amx, bench.kv_int8): model, the
    concurrencies, turns, interleaved rounds and the workload's seed."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7919)
    ap.add_argument("--long-system-prompt", action=LongSystemPrompt)
    return ap


def run_pagedchat(llm: LLM, concurrency: int, turns: int, seed: int, salted: bool = False) -> dict:
    """salted: each session's turns carry their own cache_salt (no prefix shared across sessions)."""
    eng = llm.engine
    llm.reset_prefix_cache()
    before = eng.get_stats()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    sessions = {str(i): Session(i, turns, seed) for i in range(concurrency)}
    turn_no = dict.fromkeys(sessions, 0)
    ttfts, generated, replies = [], 0, {}

    def submit(sid: str) -> None:
        msgs = sessions[sid].next_messages()
        if msgs is not None:
            turn_no[sid] += 1
            eng.add_request(llm.render_chat(msgs), params, request_id=f"{sid}-{turn_no[sid]}",
                            cache_salt=f"user:{sid}" if salted else None)

    t0 = time.perf_counter()
    for sid in sessions:
        submit(sid)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                sid = out.request_id.split("-")[0]
                generated += len(out.outputs[0].token_ids)
                replies[out.request_id] = out.outputs[0].token_ids
                ttfts.append(out.metrics.time_to_first_token)
                sessions[sid].add_reply(out.outputs[0].text)
                submit(sid)
    seconds = time.perf_counter() - t0
    after = eng.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return dict(tok_s=generated / seconds, generated=generated, seconds=seconds, computed=queries - hits, replies=replies,
                ttft_p50=_pct(ttfts, 50), ttft_p95=_pct(ttfts, 95), hit_rate=hits / max(queries, 1))


def run_transformers(model, tokenizer, concurrency: int, turns: int, seed: int) -> dict:
    """Static batching: every turn of all C sessions is one padded `generate` call."""
    sessions = [Session(i, turns, seed) for i in range(concurrency)]
    tokenizer.padding_side = "left"
    generated = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        texts = [tokenizer.apply_chat_template(s.next_messages(), tokenize=False, add_generation_prompt=True)
                 for s in sessions]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for s, row in zip(sessions, out[:, batch["input_ids"].shape[1]:].tolist()):
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            generated += len(row)
            s.add_reply(tokenizer.decode(row, skip_special_tokens=True))
    seconds = time.perf_counter() - t0
    return dict(tok_s=generated / seconds, generated=generated, seconds=seconds)


def run_openai(url: str, model: str, concurrency: int, turns: int, seed: int) -> dict:
    """The same sessions against an OpenAI-compatible server (vLLM, llama.cpp, pagedchat)."""
    import threading
    import urllib.request

    ttfts, generated, lock = [], [0], threading.Lock()

    def chat(index: int) -> None:
        s = Session(index, turns, seed)
        while (msgs := s.next_messages()) is not None:
            body = json.dumps(dict(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                   stream_options={"include_usage": True})).encode()
            req = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
            start, first, text, usage = time.perf_counter(), None, "", 0
            with urllib.request.urlopen(req, timeout=600) as resp:
                for line in resp:
                    line = line.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta", {}).get("content") or ""
                        if delta and first is None:
                            first = time.perf_counter() - start
                        text += delta
            s.add_reply(text)
            with lock:
                generated[0] += usage
                if first is not None:
                    ttfts.append(first)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return dict(tok_s=generated[0] / seconds, generated=generated[0], seconds=seconds,
                ttft_p50=_pct(ttfts, 50), ttft_p95=_pct(ttfts, 95))


def profile_step(llm: LLM, batch: int, seed: int) -> dict:
    """One decode step at `batch`: its time, the share spent in Python scheduling and input
    preparation, and ms per step by kind of module (each Linear's kernel, attention, norms, rotary,
    activation, the LM head; the rest is sampling and glue), timed by forward hooks."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(batch):
        s = Session(i, 2, seed)
        eng.add_request(llm.render_chat(s.next_messages()), params, request_id=f"p{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.num_waiting:
        eng.step()
    timings = {"schedule": 0.0, "prepare": 0.0, "step": 0.0}
    schedule, prepare = eng.scheduler.schedule, eng.runner._prepare

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name] += time.perf_counter() - t
        return wrapper

    eng.scheduler.schedule, eng.runner._prepare = timed("schedule", schedule), timed("prepare", prepare)
    by_kind: dict[str, float] = {}
    hooks = []
    for name, module in eng.model.named_modules():
        if any(True for _ in module.children()):
            continue  # containers: their parts are timed
        kind = "lm_head" if name == "lm_head" else type(module).__name__ + (
            f" ({type(module.kernel).__name__})" if hasattr(module, "kernel") else "")
        started = {}
        hooks.append(module.register_forward_pre_hook(lambda m, a, s=started: s.__setitem__(0, time.perf_counter())))
        hooks.append(module.register_forward_hook(
            lambda m, a, o, s=started, k=kind: by_kind.__setitem__(k, by_kind.get(k, 0.0) + time.perf_counter() - s[0])))
    fused = cpu_kernels.decoder_layers  # the decoder stack as one C call skips the layers' hooks: timed whole

    def fused_timed(*a, **k):
        t = time.perf_counter()
        try:
            return fused(*a, **k)
        finally:
            kind = "decoder layers, one C call (engine/fused_layers.py)"
            by_kind[kind] = by_kind.get(kind, 0.0) + time.perf_counter() - t
    cpu_kernels.decoder_layers = fused_timed
    steps = 10
    try:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            timings["step"] += time.perf_counter() - t
    finally:
        cpu_kernels.decoder_layers = fused
    for h in hooks:
        h.remove()
    eng.scheduler.schedule, eng.runner._prepare = schedule, prepare
    for i in range(batch):
        eng.abort_request(f"p{i}")
    eng.step()
    return dict(step_ms=timings["step"] / steps * 1000,
                python_share=(timings["schedule"] + timings["prepare"]) / timings["step"],
                by_kind={k: v / steps * 1000 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])})


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-baseline", action="store_true", help="skip transformers static batching")
    p.add_argument("--openai-url", default=None, help="also drive this OpenAI-compatible server")
    p.add_argument("--served-model", default="default")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--long-system-prompt", action=LongSystemPrompt)
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.max_num_seqs)
    print(f"model {llm.engine.source.name}, {llm.engine.dtype}, {torch.get_num_threads()} threads, "
          f"{args.turns} turns per session, max_tokens {MAX_TOKENS}")
    ours = {c: run_pagedchat(llm, c, args.turns, args.seed) for c in args.concurrency}
    rss = _peak_rss_mib()
    prof = profile_step(llm, args.profile_batch, args.seed) if args.profile_batch else None
    theirs, server = {}, {}
    if not args.no_baseline:
        model, tokenizer = _transformers_model(llm)
        theirs = {c: run_transformers(model, tokenizer, c, args.turns, args.seed) for c in args.concurrency}
    if args.openai_url:
        server = {c: run_openai(args.openai_url, args.served_model, c, args.turns, args.seed)
                  for c in args.concurrency}

    print("\n| sessions | pagedchat tok/s | transformers tok/s | ratio | TTFT p50 | TTFT p95 | prefix hit rate |"
          + (" server tok/s | server TTFT p50 |" if server else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if server else ""))
    for c in args.concurrency:
        o, t = ours[c], theirs.get(c)
        base = f"{t['tok_s']:.0f}" if t else "-"
        ratio = f"{o['tok_s'] / t['tok_s']:.1f}x" if t else "-"
        row = (f"| {c} | {o['tok_s']:.0f} | {base} | {ratio} | {o['ttft_p50'] * 1000:.0f} ms | "
               f"{o['ttft_p95'] * 1000:.0f} ms | {o['hit_rate']:.0%} |")
        if server:
            s = server[c]
            row += f" {s['tok_s']:.0f} | {s['ttft_p50'] * 1000:.0f} ms |"
        print(row)
    print(f"\npeak RSS of pagedchat (before the baseline loads): {rss:.0f} MiB")
    if prof:
        print(f"decode step at batch {args.profile_batch}: {prof['step_ms']:.1f} ms, "
              f"Python scheduling + input preparation {prof['python_share']:.1%} of it")
        print("\n| part of the step | ms | share |\n|---|---|---|")
        for kind, ms in prof["by_kind"].items():
            print(f"| {kind} | {ms:.1f} | {ms / prof['step_ms']:.0%} |")
        rest = prof["step_ms"] - sum(prof["by_kind"].values())
        print(f"| the rest (sampling, scheduling, inputs, glue) | {rest:.1f} | {rest / prof['step_ms']:.0%} |")


def _transformers_model(llm: LLM):
    """transformers' own model with the same weights and dtype, from the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from engine.checkpoint.load import iter_weights

    eng = llm.engine
    model = AutoModelForCausalLM.from_config(eng.hf_config, dtype=eng.dtype)
    model.load_state_dict(dict(iter_weights(eng.source, eng.hf_config)), strict=False)
    model.tie_weights()
    return model.eval(), eng.tokenizer


if __name__ == "__main__":
    main()
