"""Our forward against transformers' reference forward of the same weights, through the paged
KV cache: a whole-prompt prefill, a prefill on top of cached blocks, and single-token decodes."""
import pytest
import torch

from engine import LLM
from engine.kv_cache_manager import OUT_OF_WINDOW
from engine.outputs import ScheduledRequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.conftest import TINY_ARCHS

pytestmark = pytest.mark.e2e


def paged_logits(llm: LLM, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, computing the sequence in the given chunk sizes so later chunks
    read earlier ones from the block pool (a chunk of 1 is a decode step)."""
    engine = llm.engine
    req = Request("parity", token_ids, SamplingParams())
    kv, runner = engine.kv, engine.runner
    rows = []
    try:
        for n in chunks:
            assert kv.allocate_slots(req, n)
            rows.append(runner.logits_for_all(ScheduledRequest(req, n, kv.block_ids(req.request_id))))
            req.num_computed_tokens += n
    finally:
        kv.free(req)
    return torch.cat(rows)


def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < rel, f"max relative error {err:.2e} >= {rel:.0e}"


@pytest.mark.parametrize("kernels", ["C kernels", "torch ops"])  # torch ops: the path CUDA takes
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_match_transformers(arch, kernels, tiny_model, monkeypatch):
    from engine import cpu_kernels

    if kernels == "torch ops":
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    path, hf_model = tiny_model(arch)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
    ids = [int(t) for t in torch.randint(0, hf_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(0))]
    ref = reference_logits(hf_model, ids)
    assert_close(paged_logits(llm, ids, [45]), ref, 1e-4)
    # 20 tokens, then 20 more over the cached blocks, then five single-token decode steps
    assert_close(paged_logits(llm, ids, [20, 20, 1, 1, 1, 1, 1]), ref, 1e-4)
    llm.engine.check_integrity()


def test_smollm2_gguf_matches_transformers(smol32, hf_smol):
    tok = smol32.get_tokenizer()
    ids = tok.encode("Hello! My order #4417 arrived damaged. Can I get a replacement or a refund?")
    ref = reference_logits(hf_smol, ids)
    n = len(ids)
    assert_close(paged_logits(smol32, ids, [n]), ref, 1e-4)
    assert_close(paged_logits(smol32, ids, [n - 3, 1, 1, 1]), ref, 1e-4)


def test_greedy_equals_transformers_generate(smol32, hf_smol):
    tok = smol32.get_tokenizer()
    messages = [{"role": "user", "content": "How do I reset my password?"}]
    prompt_ids = smol32.render_chat(messages)
    with torch.no_grad():
        # An explicit mask: the prompt contains <|im_end|>, which is also the pad token, and
        # generate would otherwise mask those positions out.
        ids = torch.tensor([prompt_ids])
        ref = hf_smol.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.eos_token_id)[0, len(prompt_ids):].tolist()
    ours = smol32.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == ref


@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-window", "gemma2", "gemma3"])
def test_windows_and_gemma_generate_what_transformers_generates(arch, tiny_model):
    """Greedy through the whole engine (scheduler, chunked prefill, prefix cache, decode steps),
    with prompts longer than the window of 8 and a second prompt sharing the first's blocks."""
    path, hf_model = tiny_model(arch)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    gen = torch.Generator().manual_seed(3)
    first = [int(t) for t in torch.randint(0, hf_model.config.vocab_size, (40,), generator=gen)]
    prompts = [first, first[:32] + [int(t) for t in torch.randint(0, hf_model.config.vocab_size, (9,), generator=gen)]]
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    assert ours[1].num_cached_tokens >= 32  # the second prompt found the first's blocks cached
    llm.engine.check_integrity()


def test_blocks_out_of_every_window_go_back_to_the_pool(tiny_model):
    """Mistral with a window of 8 and blocks of 16: a 100-token reply holds at most the blocks its
    window touches (not all 9 of its table), block 0's id stands in for the rest, and the greedy
    tokens still equal transformers'; a model with one global layer (qwen2-window) frees nothing."""
    path, hf_model = tiny_model("mistral-window")
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    assert llm.engine.kv.window == 8
    prompt = [int(t) for t in torch.randint(0, hf_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))]
    engine, held = llm.engine, []
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), request_id="long")
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if "long" in engine.kv.req_blocks:
            table = engine.kv.req_blocks["long"]
            held.append(sum(1 for b in table if b is not OUT_OF_WINDOW))
            engine.kv.pool.check_integrity()
    assert max(held) <= 3 and held[-1] <= 2, held  # a window of 8 spans at most two blocks of 16, plus the new one
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens == ref
    engine.check_integrity()
    twins = llm.generate([prompt], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=60, ignore_eos=True))
    assert [len(c.token_ids) for c in twins[0].outputs] == [60, 60]  # forked tables with stand-ins in them
    engine.check_integrity()
    path, _ = tiny_model("qwen2-window")
    assert LLM(path, dtype="float32", num_kv_blocks=64).engine.kv.window is None
