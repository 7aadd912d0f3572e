"""Batched sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, min_tokens, per-request seeds, and the masking path (logit_bias,
allowed_token_ids, bad_words, structured-output grammars). Penalties are applied to the batch at
once (engine/penalties.py); only masks and seeded draws touch rows one by one."""
from __future__ import annotations

import itertools

import torch

from engine import cpu_kernels, nucleus
from engine.penalties import apply_penalties
from engine.request import Request
from engine.speculative import accept
from engine.structured import apply_draft_masks, apply_grammar_masks


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.processed: torch.Tensor | None = None

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [N, V] float32, one row per request that samples this step. Leaves in `processed`
        the logits of the distribution sampled from, before top-k / top-p / min-p (processed logprobs)."""
        params = [r.params for r in requests]
        self.processed = logits
        if all(p.greedy and not p.has_penalties and not p.masks_logits and r.num_output_tokens >= p.min_tokens
               for r, p in zip(requests, params)):
            return _argmax(logits).tolist()
        logits = logits.clone()  # rows are adjusted in place; a failed draw is retried on the originals
        for i, req in enumerate(requests):
            if _masks(req):
                self._mask_row(logits[i], req)
        apply_penalties(logits, requests)
        apply_grammar_masks(logits, [r.grammar for r in requests])
        greedy_tokens = _argmax(logits)
        self.processed = logits
        if all(p.greedy for p in params):
            return greedy_tokens.tolist()
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        logits = self.processed = logits / temps.unsqueeze(1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        tokens = greedy_tokens.clone()
        tokens[rows] = self._draw(logits[rows], [requests[i] for i in rows])
        return tokens.tolist()

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of tempered logits, after top-k / top-p / min-p: among the row's shortlist
        where that decides the filters (engine/nucleus.py), else over the whole vocabulary."""
        params = [r.params for r in requests]
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        found, rest = nucleus.shortlists(logits, params)
        for short in found:
            if not short.rows:
                continue
            order = short.ids.argsort(dim=-1)  # token-id order: equal logits, however topk ranked them, draw alike
            ids, kept = short.ids.gather(1, order), short.logits.gather(1, order)
            picks = self._inverse_cdf(kept, [requests[i] for i in short.rows])
            tokens[short.rows] = ids.gather(1, picks.unsqueeze(1)).squeeze(1)
        if rest:
            full = nucleus.filtered_by_sort(logits[rest], [params[i] for i in rest])
            tokens[rest] = self._inverse_cdf(full, [requests[i] for i in rest])
        return tokens

    def _inverse_cdf(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's draw from softmax(logits): one uniform number against the cumulative weights
        (summed in float64, so that no tail token's weight is lost to rounding). A seeded request's
        number comes from its own generator, whatever else shares the step."""
        weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()
        cum = weights.to(torch.float64).cumsum_(dim=-1)
        total = cum[:, -1:]
        u = torch.rand(len(requests), 1, generator=self.generator, device=logits.device, dtype=torch.float64)
        for i, req in enumerate(requests):
            if req.params.seed is not None:
                u[i] = torch.rand(1, generator=self._generator_for(req), device=logits.device, dtype=torch.float64)
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cum, target, right=True).squeeze(1)

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> list[list[int]]:
        """Requests that drafted (engine/speculative.py): their 1 + len(drafts) rows each, in order, in
        `logits`. Row i is adjusted as if drafts[:i] were already the request's tokens (penalties, bias,
        masks, min_tokens, the grammar: what the plain path does at that position). Returns each one's kept tokens:
        the argmax rule for greedy rows, the rejection rule on the tempered, filtered distribution
        (top-k / top-p / min-p) for the others."""
        sizes = [1 + len(d) for d in drafts]
        starts = list(itertools.accumulate(sizes, initial=0))  # each request's first row
        if any(_masks(r) or r.params.has_penalties for r in requests):
            logits = logits.clone()
            for req, d, row in zip(requests, drafts, starts):
                for i in range(len(d) + 1) if _masks(req) else ():
                    self._mask_row(logits[row + i], req, d[:i])
            apply_penalties(logits, [req for req, n in zip(requests, sizes) for _ in range(n)],
                            [d[:i] for d in drafts for i in range(len(d) + 1)])
            for req, d, row in zip(requests, drafts, starts):
                if req.grammar is not None:
                    apply_draft_masks(logits[row:row + len(d) + 1], req.grammar, d)
        targets = _argmax(logits).split(sizes)
        sampling = [i for i, r in enumerate(requests) if not r.params.greedy]
        probs: dict[int, torch.Tensor] = {}
        if sampling:
            rows = torch.tensor([starts[i] + j for i in sampling for j in range(sizes[i])], device=logits.device)
            params = [requests[i].params for i in sampling for _ in range(sizes[i])]
            temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
            chosen = nucleus.filtered(logits[rows] / temps, params).softmax(dim=-1).split([sizes[i] for i in sampling])
            probs = dict(zip(sampling, chosen))
        return [accept(probs[i], d, self.generator) if i in probs else accept(targets[i], d, None)
                for i, d in enumerate(drafts)]

    def _generator_for(self, req: Request) -> torch.Generator:
        g = self._request_generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed)
            self._request_generators[req.request_id] = g
        return g

    @staticmethod
    def _mask_row(row: torch.Tensor, req: Request, ahead: list[int] | tuple = ()) -> None:
        """min_tokens, bias and masks on one row of logits, for the position after the request's
        tokens and `ahead` (drafts taken as kept when a draft row is verified)."""
        p = req.params
        tokens = req.all_token_ids + list(ahead) if ahead else req.all_token_ids
        if req.num_output_tokens + len(ahead) < p.min_tokens:
            banned = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if t < row.numel()]
            if banned:
                row[banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype)
        if p.allowed_token_ids:
            keep = torch.full_like(row, float("-inf"))
            keep[p.allowed_token_ids] = 0.0
            row += keep
        for word in req.bad_words_ids:
            if len(word) == 1 or tokens[-(len(word) - 1):] == word[:-1]:
                row[word[-1]] = float("-inf")


def _masks(req: Request) -> bool:
    """Whether _mask_row may change anything for this request now (else its rows skip it)."""
    p = req.params
    return p.masks_logits or req.num_output_tokens < p.min_tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row, as argmax: our C pass on the CPU (engine/csrc/argmax.c), else
    max(dim).indices, 2x faster than argmax on the CPU (1.3 against 2.7 ms for 64 rows of a
    49152-token vocabulary)."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous() and cpu_kernels.supports(logits) \
            and cpu_kernels.available():
        return cpu_kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices
