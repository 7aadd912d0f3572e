"""End-to-end engine behaviour on the real SmolLM2 weights (fp32): greedy outputs do not depend on
how the engine batches, pages, chunks, caches, preempts or drafts; prefix caching reuses what it should.
The reference is one request at a time, drafting nothing; the other runs draft at every step
(`always_draft`) whatever the measured policy says (speculation is on by default)."""
import pytest

from ui.simulate import CUSTOMER_SERVICE_PROMPT as SYSTEM_PROMPT
from ui.simulate import user_turns
from engine import LLM, SamplingParams
from engine.speculative import DraftPolicy

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smol32):
    """16 chats sharing the system prompt, as token ids."""
    return [smol32.render_chat([{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": user_turns(i, 1)[0]}]) for i in range(16)]


def _patched(k):
    """Overrides the measured draft policy: each decoding request drafts k tokens ("all": the configured k)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(DraftPolicy, "max_drafts", lambda self, decoding: self.k if k == "all" else k)
    return mp


@pytest.fixture(scope="module")
def reference(smol32, prompts):
    """One request at a time, prefix caching off (cache reset before each request), no drafts."""
    outs, mp = [], _patched(0)
    for p in prompts:
        smol32.reset_prefix_cache()
        outs.append(smol32.generate([p], GREEDY)[0].outputs[0].token_ids)
    mp.undo()
    return outs


@pytest.fixture
def always_draft():
    mp = _patched("all")
    yield
    mp.undo()


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_of_16_with_prefix_cache_and_drafts_equals_one_at_a_time(smol32, prompts, reference, always_draft):
    before = smol32.get_stats().spec_decode_num_accepted_tokens
    outs = smol32.generate(prompts, GREEDY)
    assert tokens(outs) == reference
    assert sum(o.num_cached_tokens for o in outs) > 0  # the shared system prompt was reused
    assert smol32.get_stats().spec_decode_num_accepted_tokens - before > 20  # several tokens a step, often
    smol32.engine.check_integrity()


def test_stops_inside_kept_drafts_end_the_reply_as_without_them(smol32, prompts, reference):
    """A stop string or max_tokens met among the tokens one step keeps ends the reply there; penalties,
    bias, min_tokens and a grammar apply to each draft row as at its position."""
    texts = [smol32.get_tokenizer().decode(ids) for ids in reference[:4]]
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[t[40:44]]) for t in texts] + \
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 13)] + \
        [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, min_tokens=20, logit_bias={13: 2.0}),
         SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": "(order [0-9]+, )+"})]
    batch = prompts[:8]
    replies = []
    for k in (0, "all"):
        mp = _patched(k)
        before = smol32.get_stats().spec_decode_num_accepted_tokens
        outs = smol32.generate(batch, params)
        kept = smol32.get_stats().spec_decode_num_accepted_tokens - before
        mp.undo()
        replies.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
    assert replies[0] == replies[1] and kept > 0
    assert [r[2] for r in replies[1]] == ["stop"] * 4 + ["length"] * 4
    smol32.engine.check_integrity()


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(block_size=32),
    dict(max_num_batched_tokens=24),  # every prompt prefilled in chunks, mixed with decodes
    dict(num_kv_blocks=40, max_model_len=640),  # 16 sequences of ~170 tokens cannot all fit
], ids=["no-prefix-cache", "block-32", "chunked-prefill", "preemption"])
@pytest.mark.slow
def test_greedy_identical_under_engine_options(options, prompts, reference, always_draft):
    llm = LLM(dtype="float32", quantization="none", **{"num_kv_blocks": 1024, **options})  # as smol32
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == reference
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    if "max_num_batched_tokens" in options:
        computed = stats.prompt_tokens_total - stats.prefix_cache_hits
        assert stats.num_steps >= computed // 24 > 16  # far more steps than prompts: chunked
    assert stats.kv_blocks_used == 0
    llm.engine.check_integrity()


def test_shared_system_prompt_is_cached(smol32):
    smol32.reset_prefix_cache()
    first, second = (smol32.render_chat([{"role": "system", "content": SYSTEM_PROMPT},
                                         {"role": "user", "content": user_turns(i, 1)[0]}]) for i in (1, 2))
    system_len = len(smol32.render_chat([{"role": "system", "content": SYSTEM_PROMPT}], add_generation_prompt=False))
    assert system_len >= 300
    smol32.generate([first], GREEDY)
    out = smol32.generate([second], GREEDY)[0]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert out.num_cached_tokens == (common // 16) * 16 >= 288


def test_second_turn_reuses_the_whole_history(smol32):
    smol32.reset_prefix_cache()
    tok = smol32.get_tokenizer()
    turns = user_turns(7, 2)
    turn1 = smol32.render_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": turns[0]}])
    out1 = smol32.generate([turn1], SamplingParams(temperature=0, max_tokens=40))[0]
    history = turn1 + out1.outputs[0].token_ids
    suffix = tok.encode(f"\n<|im_start|>user\n{turns[1]}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out2 = smol32.generate([history + suffix], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out2.num_cached_tokens >= len(history) - 16
    stats = smol32.get_stats()
    assert 0 < stats.prefix_cache_hits <= stats.prefix_cache_queries


def test_stop_strings_are_cut_and_reported(smol32, prompts, reference):
    tok = smol32.get_tokenizer()
    text = tok.decode(reference[0])
    stop = text.split()[3]
    out = smol32.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert stop not in out.outputs[0].text
    assert text.startswith(out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_seeded_sampling_is_reproducible_and_batch_independent(smol32, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    alone = smol32.generate([prompts[3]], params)[0].outputs[0].token_ids
    batched = smol32.generate(prompts[:6], [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [params]
                              + [SamplingParams(temperature=1.0, max_tokens=16)] * 2)
    assert batched[3].outputs[0].token_ids == alone
    other = smol32.generate([prompts[3]], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7,
                                                         max_tokens=16, ignore_eos=True))[0]
    assert other.outputs[0].token_ids != alone


def test_chat_returns_text_metrics_and_finish_reason(smol32):
    out = smol32.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == smol32.get_tokenizer().eos_token_id
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_the_shared_prefix_cascade_keeps_greedy_outputs(smol32, prompts, monkeypatch):
    """32 chats sharing the system prompt decode together: with batch_invariant off the cascade attends
    to the prefix once for all of them (fp32: the tokens equal those of per-sequence attention); with it
    on (the default) there is no cascade."""
    from engine import attention, cascade

    batch = prompts * 2
    monkeypatch.setattr(cascade, "MIN_SHARING_ROWS", 24)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 0)  # the ~300-token system prompt is shared
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS_KERNEL", 0)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS_PLAIN", 0)
    calls = []
    operands = attention.PagedAttention.shared_operands  # the modules' cascade and the fused stack's take them
    monkeypatch.setattr(attention.PagedAttention, "shared_operands",
                        lambda self, shared, dtype: calls.append(1) or operands(self, shared, dtype))
    per_sequence = tokens(smol32.generate(batch, GREEDY))
    assert not calls
    monkeypatch.setattr(smol32.engine.runner, "cascade", True)  # as batch_invariant off makes it
    assert tokens(smol32.generate(batch, GREEDY)) == per_sequence
    assert calls  # the cascade did run
    smol32.engine.check_integrity()


def test_few_rows_run_the_layers_on_one_thread_and_the_lm_head_on_all(tiny_model, monkeypatch):
    """A small model's decode of a few rows runs its layers on one thread (engine/model_runner.py),
    the LM head on every thread, and the setting is restored after the step; larger batches keep all."""
    import torch

    from engine import model_runner

    path, _ = tiny_model("llama")
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, num_threads=2)
    model, seen = llm.engine.model, []
    layer_forward, head = model.model.layers[0].forward, model.compute_logits
    monkeypatch.setattr(model.model.layers[0], "forward",
                        lambda *a: seen.append(("layers", torch.get_num_threads())) or layer_forward(*a))
    monkeypatch.setattr(model, "compute_logits", lambda h: seen.append(("head", torch.get_num_threads())) or head(h))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[100 + i] * 8 for i in range(model_runner.ONE_THREAD_ROWS + 1)]  # all prefill in one step
    llm.generate(prompts[:1], params)
    assert ("layers", 1) in seen and ("head", 2) in seen and ("head", 1) not in seen
    assert torch.get_num_threads() == 2
    seen.clear()
    llm.generate(prompts, params)  # every step has more rows than ONE_THREAD_ROWS
    assert seen and all(threads == 2 for _, threads in seen)


def test_decode_attention_takes_every_thread_only_for_long_contexts(tiny_model, monkeypatch):
    """Short decodes run the attention kernel on one thread (waking another costs more), a step with
    PARALLEL_ATTENTION_TOKENS of context on all of them, even when its layers run on one."""
    from engine import cpu_kernels, model_runner

    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    path, _ = tiny_model("llama")
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=256, num_threads=2)
    kernel, seen = cpu_kernels.paged_decode_attention, []
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention",
                        lambda *a, threads=None, **k: seen.append(threads) or kernel(*a, threads=threads, **k))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([[100] * 40], params)
    assert seen and set(seen) == {1}
    seen.clear()
    long = model_runner.PARALLEL_ATTENTION_TOKENS // 6 + 1
    llm.generate([[100 + i] * long for i in range(6)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert 2 in seen  # once all six decode together (6 rows: the layers still on one thread)



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunks_are_attended_row_by_row(dtype, tiny_model, monkeypatch):
    """A prompt chunk goes through the decode kernel, one row per token, each over its own prefix: in
    fp32 while its context fits ROW_PREFILL_CONTEXT (a longer one through SDPA, the same greedy text),
    in bf16 on AVX-512 BF16 whatever its length."""
    from engine import attention, cpu_kernels, model_runner

    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    path, _ = tiny_model("llama")
    prompt = [100 + (i * 7) % 300 for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kernel, rows = cpu_kernels.paged_decode_attention, []
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda q, *a, **k: rows.append(q.shape[0]) or kernel(q, *a, **k))
    sdpa, chunks = attention.PagedAttention._prefill, []
    monkeypatch.setattr(attention.PagedAttention, "_prefill", lambda self, q, *a: chunks.append(q.shape[0]) or sdpa(self, q, *a))
    by_rows = LLM(path, dtype=dtype, num_kv_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    assert 70 in rows and not chunks
    rows.clear()
    monkeypatch.setattr(model_runner, "ROW_PREFILL_CONTEXT", 32)
    past_the_limit = LLM(path, dtype=dtype, num_kv_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    if dtype == "bfloat16" and cpu_kernels.has("bf16_attention"):
        assert 70 in rows and not chunks
    else:
        assert 70 in chunks and max(rows) == 1
    assert by_rows == past_the_limit


def test_a_long_prompt_replies_the_same_alone_in_a_batch_and_from_the_cache():
    """bf16 on AVX-512 BF16, the default model, a system prompt past 1024 tokens (the shop's policies): its
    chunks are attended row by row and nothing cascades (batch_invariant), so each reply is the same token
    for token computed alone, beside the others with drafts, and again from the prefix cache."""
    import glob
    import os

    from engine import cpu_kernels

    if not cpu_kernels.has("bf16_attention"):
        pytest.skip("bf16 prompt rows past 1024 tokens need AVX-512 BF16")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "knowledge", "*.md")
    system = SYSTEM_PROMPT + "\n\n" + "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob(docs)))
    llm = LLM(dtype="bfloat16", num_kv_blocks=1024, max_model_len=4096)
    prompts = [llm.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user_turns(i, 1)[0]}])
               for i in range(8)]
    assert len(prompts[0]) > 1100
    alone = []
    for p in prompts:
        llm.reset_prefix_cache()
        alone.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
    llm.reset_prefix_cache()
    mp = _patched("all")
    try:
        assert tokens(llm.generate(prompts, GREEDY)) == alone
    finally:
        mp.undo()
    out = llm.generate(prompts[:1], GREEDY)[0]
    assert out.outputs[0].token_ids == alone[0] and out.num_cached_tokens > 1024


def test_long_chunks_stay_with_sdpa_where_a_layer_leaves_the_kernel(tiny_model):
    """Gemma 2's softcapped attention takes the torch path, which gathers every row's whole context."""
    from engine import cpu_kernels, model_runner

    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    runner = LLM(tiny_model("gemma2")[0], dtype="bfloat16", num_kv_blocks=64).engine.runner
    assert runner.row_context == model_runner.ROW_PREFILL_CONTEXT
