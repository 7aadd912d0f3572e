"""Sampler filters on hand-made logits, and a failing step that comes back as errors."""
import pytest
import torch

from engine import SamplingParams
from engine.request import Request
from engine.sampler import Sampler


def rows(params_list, logits):
    reqs = [Request(str(i), [1, 2, 3], p) for i, p in enumerate(params_list)]
    return Sampler(0, torch.device("cpu")), reqs, torch.tensor(logits, dtype=torch.float32)


def draws(params, logits, n=300):
    sampler, reqs, x = rows([params] * n, [logits] * n)
    return set(sampler(x.clone(), reqs))


def test_greedy_is_argmax():
    sampler, reqs, x = rows([SamplingParams(temperature=0)] * 2, [[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sampler(x, reqs) == [1, 0]


def test_our_argmax_is_torch_argmax_with_ties_nans_and_infinities():
    from engine import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 256, 1000, 49152):
        x = torch.randn(9, n, generator=g)
        x[1] = float("-inf")
        x[2] = 0.5  # all tied: the first
        x[3, n // 2] = x[3, n - 1] = 50.0  # a tie: the first
        x[4, n - 1] = float("nan")  # NaN after the maximum still wins
        x[5, n // 3] = float("nan")
        x[5, n - 1] = float("nan")  # the first NaN
        x[6, 0] = float("inf")
        assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1)), n


def test_top_k_top_p_min_p_limit_the_candidates():
    logits = [2.0, 1.9, 1.8, 0.0, -1.0]
    assert draws(SamplingParams(temperature=1.0), logits) == {0, 1, 2, 3, 4}
    assert draws(SamplingParams(temperature=1.0, top_k=2), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, min_p=0.5), logits) == {0, 1, 2}


def test_penalties_and_min_tokens_change_the_choice():
    # the prompt is [1, 2, 3]: halving their logits leaves unseen token 4 on top
    sampler, reqs, x = rows([SamplingParams(temperature=0, repetition_penalty=2.0)], [[0, 1.5, 1.4, 1.0, 0.9]])
    assert sampler(x, reqs) == [4]
    sampler, reqs, x = rows([SamplingParams(temperature=0, presence_penalty=1.0)], [[0, 1.5, 1.4, 1.0]])
    reqs[0].append_output_token(1)  # presence counts generated tokens only
    assert sampler(x, reqs) == [2]
    sampler, reqs, x = rows([SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])], [[0, 9.0, 1.0, 0]])
    assert sampler(x, reqs) == [2]


def test_failed_step_returns_errors_and_frees_blocks(tiny_model, monkeypatch):
    from engine import LLM

    path, _ = tiny_model("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=16)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), request_id="doomed")

    def boom(sched):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.runner, "execute", boom)
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("doomed", "error")]
    assert "kernel exploded" in outs[0].error
    assert engine.get_stats().kv_blocks_used == 0
    monkeypatch.undo()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_shortlisted_filters_keep_what_the_whole_sorted_vocabulary_keeps():
    """top-k / top-p / min-p decided among each row's likeliest tokens keep exactly the tokens the
    sort of the whole vocabulary keeps, for peaked rows and for flat ones (which fall back)."""
    from engine import nucleus

    g = torch.Generator().manual_seed(5)
    settings = [dict(top_p=0.9), dict(top_p=0.5, top_k=20), dict(top_k=3), dict(top_k=200), dict(min_p=0.1),
                dict(min_p=0.001), dict(top_p=0.99, min_p=0.05), dict(top_p=0.95, top_k=100), dict(), dict(top_p=1.0)]
    for scale in (0.3, 2.5, 12.0):  # flat (most rows fall back), realistic (the wider shortlist), peaked
        logits = torch.randn(len(settings) * 3, 5000, generator=g) * scale
        params = [SamplingParams(temperature=1.0, **s) for s in settings] * 3
        ours, sorted_ = nucleus.filtered(logits, params), nucleus.filtered_by_sort(logits, params)
        assert torch.equal(ours.isfinite(), sorted_.isfinite()), scale
        assert torch.equal(ours[ours.isfinite()], logits[ours.isfinite()])
    peaked = torch.randn(4, 5000, generator=g) * 12.0
    assert len(nucleus.shortlist(peaked, [SamplingParams(top_p=0.9)] * 4).rows) == 4
    wider = torch.randn(4, 5000, generator=g) * 2.5  # nuclei of hundreds: decided by the second width
    found, rest = nucleus.shortlists(wider, [SamplingParams(top_p=0.9)] * 4)
    assert [len(s.rows) for s in found] == [0, 4] and rest == []


def test_a_draw_follows_the_filtered_distribution():
    """The inverse-CDF draw: frequencies match softmax over what top-p keeps (4 sigma), and no
    dropped token is ever drawn, whether the row is decided in its shortlist or over the whole row."""
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5] + [-8.0] * 95)
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0)):
        n = 4000
        sampler, reqs, x = rows([params] * n, [logits.tolist()] * n)
        counts = torch.bincount(torch.tensor(sampler(x, reqs)), minlength=100).double()
        from engine import nucleus
        expected = nucleus.filtered(logits.unsqueeze(0), [params])[0].softmax(-1).double() * n
        assert counts[expected == 0].sum() == 0
        sigma = (expected * (1 - expected / n)).sqrt()
        assert ((counts - expected).abs() <= 4 * sigma + 1).all(), (counts[:6], expected[:6])


def test_a_seeded_draw_does_not_depend_on_what_shares_the_step():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 3000, generator=g) * 4
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    others = [SamplingParams(temperature=1.0, top_k=300), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    alone_sampler, alone, x = rows([seeded], [logits[0].tolist()])
    first = alone_sampler(x, alone)
    mixed_sampler, mixed, y = rows(others + [seeded], [logits[i].tolist() for i in (1, 2, 3, 0)])
    assert mixed_sampler(y, mixed)[-1] == first[0]
