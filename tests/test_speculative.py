"""Prompt-lookup speculative decoding: the settings, the proposer, the acceptance rule (exact for
greedy, the distribution unchanged for sampling), the draft policy, the scheduler's bookkeeping with a
fake runner. On the model (tests/test_engine.py): greedy replies identical with it on and off under
every engine option, stops inside kept drafts."""
import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative import DraftPolicy, NgramProposer, NgramSettings, accept, can_draft, ngram_settings

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize("spec, says", [
    ("{not json", "not JSON"),
    ('{"method": "eagle"}', "only method 'ngram'"),
    ({"num_speculative_tokens": 0}, "positive integer"),
    ({"num_speculative_tokens": True}, "positive integer"),
    ({"lookahead": 3}, "unknown keys ['lookahead']"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min must be at most"),
    ([1], "must be an object"),
])
def test_bad_settings_are_refused_with_the_reason(spec, says):
    with pytest.raises(ParameterError, match="speculative_config") as e:
        EngineConfig(speculative_config=spec)
    assert says in str(e.value)


def test_settings_read_vllms_json_and_off_is_none():
    assert ngram_settings('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}') == \
        NgramSettings(num_speculative_tokens=3, prompt_lookup_min=1)
    assert ngram_settings(None) is None and ngram_settings("none") is None


def request(tokens, **params):
    return Request("r", tokens, SamplingParams(**{"temperature": 0, "max_tokens": 100, **params}))


def test_the_proposer_copies_what_followed_the_latest_longest_match():
    proposer = NgramProposer(NgramSettings(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    req = request([5, 6, 7, 1, 2, 9, 9, 5, 6, 8, 4, 4, 1, 2])
    assert proposer.propose(req, 3) == [9, 9, 5]  # "1 2" ended at index 4
    req.append_output_token(9)  # "1 2 9" now: its latest earlier occurrence is the same place, longer match
    assert proposer.propose(req, 2) == [9, 5]
    req.append_output_token(3)  # "9 3" / "2 9 3" never seen
    assert proposer.propose(req, 3) == []
    req.append_output_token(5)
    req.append_output_token(6)  # "5 6": latest at index 8, followed by 8 4 4
    assert proposer.propose(req, 3) == [8, 4, 4]
    req.draft_len = 1  # its own adaptive length caps it
    assert proposer.propose(req, 3) == [8]


def test_logprobs_and_seeds_decode_one_token_a_step():
    assert can_draft(request([1, 2]))
    assert can_draft(request([1, 2], temperature=0.8, top_p=0.9, top_k=5, repetition_penalty=1.2,
                             logit_bias={3: 1.0}, min_tokens=5, bad_words=["x"], structured_outputs={"regex": "a+"}))
    for params in (dict(seed=1), dict(logprobs=2)):
        assert not can_draft(request([1, 2], **params)), params


def test_a_draft_row_is_adjusted_as_at_its_position():
    """Row i of a drafting request sees the drafts before it as the request's tokens: the repetition
    penalty covers them, and min_tokens still bans EOS until enough tokens precede the row."""
    from engine.sampler import Sampler

    req = Request("r", [1, 2], SamplingParams(temperature=0, repetition_penalty=2.0, min_tokens=2),
                  eos_token_ids=(0,))
    logits = torch.zeros(3, 6)
    logits[:, 0], logits[:, 3], logits[:, 4] = 5.0, 4.0, 3.0  # EOS best, then 3, then 4
    # row 0: EOS banned (0 outputs), 3 best -> kept; row 1: 3 now seen (halved to 2.0), EOS still
    # banned (1 output) -> 4, not the draft 3; row 2 is not reached
    assert Sampler(0, torch.device("cpu")).verify(logits, [req], [[3, 3]]) == [[3, 4]]
    assert Sampler(0, torch.device("cpu")).verify(logits, [req], [[3, 4]]) == [[3, 4, 0]]  # row 2: 2 outputs


def test_a_grammar_masks_each_draft_row_after_the_drafts_before_it(smol_tokenizer):
    """Regex "ab(c|d)": after the drafts a, b the grammar allows only c or d, so the row that
    verifies a draft "e" keeps c (the best allowed), and the matcher is left as it was."""
    from engine.sampler import Sampler
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured import GrammarCompiler

    vocab = len(smol_tokenizer)
    a, b, c, d, e = (smol_tokenizer.convert_tokens_to_ids(t) for t in "abcde")
    req = Request("r", [1, 2], SamplingParams(temperature=0, structured_outputs={"regex": "ab(c|d)"}))
    req.grammar = GrammarCompiler(smol_tokenizer, vocab, (0,)).matcher(StructuredOutputsParams(regex="ab(c|d)"))
    logits = torch.zeros(4, vocab)
    logits[:, e], logits[:, c], logits[:, a], logits[:, b] = 9.0, 5.0, 4.0, 3.0
    assert Sampler(0, torch.device("cpu")).verify(logits, [req], [[a, b, e]]) == [[a, b, c]]
    assert req.grammar.validate_tokens([a, b, d]) == 3  # rolled back: still at the start


def test_greedy_keeps_the_drafts_that_match_then_the_models_own_token():
    targets = torch.tensor([7, 8, 3, 1])
    assert accept(targets, [7, 8, 9], None) == [7, 8, 3]
    assert accept(targets, [2, 8, 3], None) == [7]
    assert accept(targets, [7, 8, 3], None) == [7, 8, 3, 1]  # all kept: one more from the last row


def test_the_rejection_rule_leaves_the_distribution_unchanged():
    """Vocabulary of 4. Whatever the draft, the first token is distributed as p0, and the second (when
    the first draft was kept) as p1: counts over 20 000 draws within 4 standard errors."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    trials = 20_000
    for drafts in ([0, 3], [3, 0], [2, 2]):
        first, second = torch.zeros(4), torch.zeros(4)
        for _ in range(trials):
            out = accept(p, drafts, g)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
        assert (first / trials - p[0]).abs().max() < 4 * (0.25 / trials) ** 0.5, drafts
        n = second.sum()
        assert (second / n - p[1]).abs().max() < 4 * (0.25 / n) ** 0.5, drafts


def test_the_policy_fits_the_step_cost_and_stops_drafting_where_it_does_not_pay():
    policy = DraftPolicy(4)
    assert policy.max_drafts(1) == 4  # nothing measured yet: try
    for step in range(200):
        for rows in (1, 3, 5, 8, 16):
            policy.record_step(rows, 0.008 + 0.0015 * rows)
        policy.record_drafts(4, step % 2)  # the first draft kept half the time, the rest never
    a, b = policy.cost_line()
    assert a == pytest.approx(0.008, rel=1e-3) and b == pytest.approx(0.0015, rel=1e-3)
    assert policy.max_drafts(1) == 1  # at one request the bar is 0.16: position 0 (kept 1/2) pays
    assert policy.max_drafts(64) == 0  # at 64 the bar is 0.92: nothing pays


def test_the_scheduler_rolls_back_rejected_drafts_and_frees_their_blocks():
    config = EngineConfig(block_size=16, speculative_config=NGRAM)
    kv = KVCacheManager(32, 4, enable_caching=True)
    sched = Scheduler(config, kv, max_model_len=1000)
    req = Request("a", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({"a": [3]}))  # prompt done, first token: "1 2 3" seen before
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft_token_ids == [4, 5, 6, 1] and s.num_tokens == 5 and len(kv.block_ids("a")) == 4
    sched.update(out, ModelRunnerOutput({"a": [4, 5, 7]}))  # two drafts kept, then the model's own 7
    assert req.output_token_ids == [3, 4, 5, 7] and req.num_computed_tokens == 11 == req.num_tokens - 1
    assert len(kv.block_ids("a")) == 3  # the block that only held rejected drafts went back
    assert (sched.spec.drafts, sched.spec.draft_tokens, sched.spec.accepted_tokens) == (1, 4, 2)
    assert sched.spec.accepted_per_pos == [1, 1, 0, 0] and req.draft_len == 3
    sched.finish(req, req.status.FINISHED_ABORTED)
    assert kv.pool.num_used == 0
    kv.pool.check_integrity()


def test_eos_inside_kept_drafts_ends_the_reply_there():
    config = EngineConfig(block_size=16, speculative_config=NGRAM)
    kv = KVCacheManager(32, 4, enable_caching=True)
    sched = Scheduler(config, kv, max_model_len=1000)
    req = Request("a", [1, 2, 3, 0, 1, 2], SamplingParams(temperature=0, max_tokens=50), eos_token_ids=(0,))
    sched.add_request(req)
    sched.update(sched.schedule(), ModelRunnerOutput({"a": [3]}))
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [0, 1, 2, 3]
    sched.update(out, ModelRunnerOutput({"a": [0, 1, 2, 3, 5]}))
    assert req.output_token_ids == [3, 0] and req.status.value == "stop" and kv.pool.num_used == 0


def test_acceptance_reaches_the_metrics_and_the_panel():
    from engine.metrics import EngineMetrics
    from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
    from ui.panel import spec_line

    metrics = EngineMetrics("m")
    stats = EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=10, spec_decode_num_accepted_tokens=6,
                        spec_decode_accepted_per_pos=[3, 2, 1])
    metrics.on_step(stats, stepped=True)
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "hi", [5], "stop")], True, metrics=RequestMetrics(0.0, 0.0, 0.0, 1.0, None, 8, 6))
    metrics.on_output(out)
    text = metrics.exposition().decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 3.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0',
                 'pagedchat:request_spec_decode_acceptance_rate_bucket{le="0.8",model_name="m"} 1.0'):
        assert line in text, line
    html = spec_line(stats.__dict__, {"on": True, "requests": {"chat-7": [8, 6]}})
    assert "kept <b id='spec-kept'>6</b>/10 draft tokens (60%)" in html and "chat-7 6/8" in html
    assert "speculation off" in spec_line(stats.__dict__, {"on": False, "requests": {}})


def test_the_grammar_mask_allows_exactly_what_llguidance_allows(smol_tokenizer):
    """Our unpacking of llguidance's bitmask against its byte-per-token view (compute_logit_bias), for
    a row wider than the tokenizer (padded vocabularies: the extra ids are never allowed)."""
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured import GrammarCompiler, apply_grammar_masks

    vocab = len(smol_tokenizer)
    compiler = GrammarCompiler(smol_tokenizer, vocab, (0,))
    matchers = [compiler.matcher(StructuredOutputsParams(regex=r"(yes|no|[0-9]{3})")), None,
                compiler.matcher(StructuredOutputsParams(json={"type": "object"}))]
    logits = torch.randn(3, vocab + 64)
    masked = logits.clone()
    apply_grammar_masks(masked, matchers)
    assert torch.equal(masked[1], logits[1])  # no matcher: untouched
    for i in (0, 2):
        allowed = torch.frombuffer(bytearray(matchers[i].compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(masked[i, :vocab][allowed], logits[i, :vocab][allowed])
        assert bool((masked[i, :vocab][~allowed] == float("-inf")).all())
        assert bool((masked[i, vocab:] == float("-inf")).all())
