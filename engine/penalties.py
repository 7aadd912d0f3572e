"""Repetition, presence and frequency penalties on a whole batch of logits at once.

The chat samples every turn with repetition_penalty 1.1, so each decode step penalises, in every
row, each distinct token of that request's context (system prompt, history, reply so far). Done row
by row (a set over the whole context, a sort, an index per row) it cost 9-14 ms a step at 64
customer-service sessions (bench.sampling); here each request keeps its distinct ids as a tensor brought up to date with the tokens
appended since its last step (SeenTokens), and one gather / scatter covers the batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request

NO_DRAFTS: tuple[int, ...] = ()


class SeenTokens:
    """A request's distinct token ids, as a CPU tensor in order of first appearance. `update` reads
    only the tokens appended since the last call; Request drops it when its output is cut short."""

    def __init__(self) -> None:
        self.count = 0
        self.ids: set[int] = set()
        self.tensor = torch.empty(0, dtype=torch.long)

    def update(self, tokens: Sequence[int]) -> torch.Tensor:
        new = [t for t in dict.fromkeys(tokens[self.count:]) if t not in self.ids]
        self.count = len(tokens)
        if new:
            self.ids.update(new)
            self.tensor = torch.cat([self.tensor, torch.tensor(new, dtype=torch.long)])
        return self.tensor


def seen_ids(req: Request, drafts: Sequence[int] = NO_DRAFTS) -> torch.Tensor:
    """The distinct ids of the request's tokens and `drafts` (taken as kept), on the CPU; a draft may
    repeat an id already there (the penalty reads each logit once, so that is harmless)."""
    if req.seen_tokens is None:
        req.seen_tokens = SeenTokens()
    ids = req.seen_tokens.update(req.all_token_ids)
    return torch.cat([ids, torch.tensor(list(drafts), dtype=torch.long)]) if drafts else ids


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request],
                    drafts: Sequence[Sequence[int]] | None = None) -> None:
    """In place on logits [N, V], row i belonging to requests[i] (and to its drafts[i], taken as
    kept): the repetition penalty divides a seen token's positive logit and multiplies a negative
    one (as transformers and vLLM do); presence and frequency penalties subtract per output token."""
    drafts = drafts or [NO_DRAFTS] * len(requests)
    repeat = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    if repeat:
        ids = [seen_ids(requests[i], drafts[i]) for i in repeat]
        rows, cols = _flat(repeat, ids, logits.device)
        penalty = torch.tensor([requests[i].params.repetition_penalty for i in repeat], dtype=logits.dtype)
        penalty = penalty.repeat_interleave(torch.tensor([len(x) for x in ids])).to(logits.device)
        flat, at = logits.view(-1), rows * logits.shape[1] + cols  # one index into the flat batch: 3x faster
        values = flat.index_select(0, at)
        flat.index_copy_(0, at, torch.where(values > 0, values / penalty, values * penalty))
    counted = [i for i, r in enumerate(requests)
               if (r.params.presence_penalty or r.params.frequency_penalty) and (r.output_token_ids or drafts[i])]
    if counted:
        outputs = [torch.tensor(requests[i].output_token_ids + list(drafts[i]), dtype=torch.long) for i in counted]
        rows, cols = _flat(range(len(counted)), outputs, logits.device)
        counts = torch.zeros(len(counted), logits.shape[1], dtype=logits.dtype, device=logits.device)
        counts.index_put_((rows, cols), torch.ones_like(cols, dtype=logits.dtype), accumulate=True)
        frequency = torch.tensor([[requests[i].params.frequency_penalty] for i in counted], dtype=logits.dtype)
        presence = torch.tensor([[requests[i].params.presence_penalty] for i in counted], dtype=logits.dtype)
        index = torch.tensor(counted, device=logits.device)
        logits[index] -= frequency.to(logits.device) * counts + presence.to(logits.device) * (counts > 0).to(logits.dtype)


def _flat(rows: Sequence[int], ids: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column) pairs for the ids of each row, built on the CPU and moved in one copy each."""
    row_index = torch.tensor(list(rows), dtype=torch.long).repeat_interleave(torch.tensor([len(x) for x in ids]))
    return row_index.to(device), torch.cat(ids).to(device)
