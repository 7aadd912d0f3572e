"""n > 1 on shared blocks: the prompt is computed once and its blocks are held once by all n
sequences (pool accounting, with the prefix cache off so only reference counts can share), the n
outputs equal n separate requests with the derived seeds, and aborting the request frees everything."""
import pytest

from engine import LLM, SamplingParams
from engine.client import BlockState
from engine.snapshot import take_snapshot

pytestmark = pytest.mark.e2e

STORY = [{"role": "user", "content": "Tell me a short story about a parcel that got lost and was found again."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048, enable_prefix_caching=False, max_num_seqs=8)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def test_n_sequences_hold_the_prompt_blocks_once(llm):
    engine, prompt = llm.engine, llm.render_chat(STORY)
    bs = engine.config.block_size
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6))
    engine.step()  # the prompt is computed once, then forked
    shared = (len(prompt) - 1) // bs  # full blocks before the one holding the last prompt token
    assert engine.get_stats().kv_blocks_used == shared + 4 < 4 * blocks_for(len(prompt), bs)
    states = take_snapshot(engine)["block_states"]
    assert sum(s == BlockState.SHARED for s in states) == shared  # what the panel outlines
    outs = llm._run([rid])[0]
    assert [c.index for c in outs.outputs] == [0, 1, 2, 3] and all(len(c.token_ids) == 6 for c in outs.outputs)
    assert engine.get_stats().kv_blocks_used == 0
    engine.check_integrity()


@pytest.mark.parametrize("tokens", [1, 12])
def test_n_outputs_equal_separate_requests_with_derived_seeds(llm, tokens):
    prompt = llm.render_chat(STORY)
    params = dict(temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True)
    together = llm.generate([prompt], SamplingParams(n=4, seed=40, **params))[0].outputs
    apart = llm.generate([prompt] * 4, [SamplingParams(seed=40 + i, **params) for i in range(4)])
    assert [c.token_ids for c in together] == [o.outputs[0].token_ids for o in apart]
    assert len({tuple(c.token_ids) for c in together}) > 1  # sampled: not four copies of one


def test_a_prompt_ending_on_a_block_boundary_copies_its_full_last_block(llm):
    bs = llm.engine.config.block_size
    prompt = llm.get_tokenizer().encode("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3)[:2 * bs]
    together = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))[0].outputs
    apart = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=1 + i, max_tokens=8) for i in range(3)])
    assert [c.token_ids for c in together] == [o.outputs[0].token_ids for o in apart]
    llm.engine.check_integrity()


def test_aborting_the_request_ends_every_sample_and_frees_all(llm):
    engine = llm.engine
    rid = engine.add_request(llm.render_chat(STORY), SamplingParams(n=3, temperature=1.0, max_tokens=500))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_running == 3
    assert engine.abort_request(rid)
    outs = engine.step()
    assert [o.finished for o in outs] == [False, False, True]  # the last sample's output closes the request
    assert {o.outputs[0].finish_reason for o in outs} == {"abort"} and {o.request_id for o in outs} == {rid}
    assert not engine.has_unfinished_requests() and engine.get_stats().kv_blocks_used == 0
    engine.check_integrity()


def test_n_is_bounded(llm):
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.engine.add_request([1, 2, 3], SamplingParams(n=llm.engine.config.max_num_seqs + 1))


def test_n_samples_share_one_prompt_scoring_and_each_has_its_own_logprobs(llm):
    prompt = llm.render_chat(STORY)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=5, logprobs=1,
                                                prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for n in (1, 3):  # a one-token prompt has one entry too, None (echo with logprobs reads it)
        one = llm.generate([prompt[:1]], SamplingParams(n=n, temperature=1.0, max_tokens=2, prompt_logprobs=1))[0]
        assert one.prompt_logprobs == [None]
    for sample in out.outputs:
        assert [t in entry for t, entry in zip(sample.token_ids, sample.logprobs)] == [True] * 5
