"""The batched penalties (engine/penalties.py) against transformers' repetition penalty and the
OpenAI presence / frequency formula applied one row at a time, over steps, drafts and a cut reply."""
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine import SamplingParams
from engine.penalties import apply_penalties
from engine.request import Request

VOCAB = 50


def reference(logits: torch.Tensor, req: Request, drafts=()) -> torch.Tensor:
    p, row = req.params, logits.clone().unsqueeze(0)
    tokens = torch.tensor([req.all_token_ids + list(drafts)])
    if p.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(tokens, row)
    counts = torch.bincount(torch.tensor(req.output_token_ids + list(drafts), dtype=torch.long), minlength=VOCAB)
    return (row[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float())


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(repetition_penalty=1.1), SamplingParams(),
              SamplingParams(repetition_penalty=1.7, presence_penalty=0.5),
              SamplingParams(frequency_penalty=0.3), SamplingParams(repetition_penalty=1.1, frequency_penalty=-0.4)]
    reqs = []
    for i, p in enumerate(params):
        req = Request(str(i), torch.randint(0, VOCAB, (20 + 7 * i,), generator=g).tolist(), p)
        for t in torch.randint(0, VOCAB, (i,), generator=g).tolist():
            req.append_output_token(t)
        reqs.append(req)
    return reqs, torch.randn(len(reqs), VOCAB, generator=g) * 3


def test_a_mixed_batch_equals_each_row_alone_step_after_step():
    reqs, _ = batch(0)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        logits = torch.randn(len(reqs), VOCAB, generator=g) * 3
        ours = logits.clone()
        apply_penalties(ours, reqs)
        for i, req in enumerate(reqs):
            assert torch.equal(ours[i], reference(logits[i], req)), (step, i)
        for req in reqs:  # the next step: one token each, often one seen before
            req.append_output_token(int(torch.randint(0, VOCAB, (1,), generator=g)))


def test_draft_rows_count_the_drafts_before_them():
    reqs, logits = batch(2)
    drafts = [[7, 7, 3], [], [4], [9, 9], [1, 2]]
    ours = logits.clone()
    apply_penalties(ours, reqs, drafts)
    for i, req in enumerate(reqs):
        assert torch.equal(ours[i], reference(logits[i], req, drafts[i])), i


def test_a_cut_reply_forgets_the_tokens_it_lost():
    req = Request("r", [1, 2], SamplingParams(repetition_penalty=2.0))
    logits = torch.full((1, VOCAB), 4.0)
    for t in (30, 31, 32):
        req.append_output_token(t)
    apply_penalties(logits.clone(), [req])  # the cache now holds 30, 31, 32
    req.truncate_output(1)  # a stop string after 30: 31 and 32 are gone
    req.append_output_token(33)
    ours = logits.clone()
    apply_penalties(ours, [req])
    assert torch.equal(ours[0], reference(logits[0], req))
    assert ours[0, 31] == 4.0 and ours[0, 33] == 2.0
