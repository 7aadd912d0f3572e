"""Speculative decoding by prompt lookup (vLLM's `ngram` method, llama.cpp's lookup decoding).

A customer-service reply copies text already in its context: order numbers, policy sentences, the
customer's own words. When the last n tokens of a request occurred before, the tokens that followed
them then are proposed as drafts. The scheduler gives a drafting request 1 + k rows instead of one;
the runner scores every row and `accept` keeps the longest prefix the model agrees with, plus the
model's own token after it. Greedy output is the same token for token; for sampling the standard
rejection rule (a draft d is kept with probability p(d), else the token is drawn from p without d)
leaves the distribution unchanged, since the draft distribution is a point mass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ParameterError
from engine.request import Request

if TYPE_CHECKING:
    import torch

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class NgramSettings:
    num_speculative_tokens: int = 4  # k: drafts per request per step, at most
    prompt_lookup_max: int = 4  # the longest suffix looked up (tried first)
    prompt_lookup_min: int = 2  # the shortest
    disable_by_batch_size: int | None = None  # no drafts while more requests run (None: DraftPolicy decides)


def ngram_settings(spec: dict | str | None) -> NgramSettings | None:
    """vLLM's speculative_config ({"method": "ngram", "num_speculative_tokens": 4, ...}, or its JSON)
    -> settings, or None when speculation is off (None, "" or "none"). ParameterError names what is wrong."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ParameterError(f"speculative_config is not JSON: {e}", "speculative_config") from None
    if not isinstance(spec, dict):
        raise ParameterError(f"speculative_config must be an object, got {spec!r}", "speculative_config")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ParameterError(f"speculative_config: unknown keys {unknown} (known: {list(KEYS)})", "speculative_config")
    if spec.get("method", "ngram") != "ngram":
        raise ParameterError(f"speculative_config: only method 'ngram' (prompt lookup) is built, got "
                             f"{spec['method']!r}", "speculative_config")
    values = {k: v for k, v in spec.items() if k != "method"}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ParameterError(f"speculative_config: {key} must be a positive integer, got {value!r}",
                                 "speculative_config")
    settings = NgramSettings(**values)
    if settings.prompt_lookup_min > settings.prompt_lookup_max:
        raise ParameterError("speculative_config: prompt_lookup_min must be at most prompt_lookup_max",
                             "speculative_config")
    return settings


def can_draft(req: Request) -> bool:
    """Logprobs are scored one token a step, and a seeded request must draw what it would without
    speculation: those decode one token at a time. Penalties, bias, masks, min_tokens and grammars
    are applied to each draft row as at its position (Sampler.verify)."""
    p = req.params
    return p.logprobs is None and p.seed is None


class NgramProposer:
    """Per request, an index of every n-gram (prompt_lookup_min..max) of its tokens -> where it last
    ended, kept up to date as tokens are appended, so a lookup costs O(1) however long the context."""

    def __init__(self, settings: NgramSettings) -> None:
        self.settings = settings
        self._index: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}  # id -> (index, [indexed up to])

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix found."""
        s, tokens = self.settings, req.all_token_ids
        limit = min(limit, req.draft_len or s.num_speculative_tokens)
        if limit < 1:
            return []
        seen, upto = self._index.setdefault(req.request_id, ({}, [0]))
        end = len(tokens) - 1  # n-grams ending before the last token: the suffix itself is not a match
        for last in range(upto[0], end):
            for n in range(s.prompt_lookup_min, min(s.prompt_lookup_max, last + 1) + 1):
                seen[tuple(tokens[last - n + 1:last + 1])] = last
        upto[0] = max(upto[0], end)
        for n in range(min(s.prompt_lookup_max, len(tokens)), s.prompt_lookup_min - 1, -1):
            at = seen.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at + 1:at + 1 + limit]
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def accept(probs_or_greedy: "torch.Tensor", drafts: list[int], generator: "torch.Generator | None") -> list[int]:
    """The tokens a request keeps from its k + 1 scored rows.

    Greedy (`generator` None): the rows' argmax tokens [k + 1]; drafts are kept while they equal
    them, then the model's own token. Sampling: the rows' probabilities [k + 1, V]; draft i is kept
    when u < p_i(d_i), else the step ends with a draw from p_i with d_i removed (renormalised); when
    every draft is kept, the last row gives one more token."""
    if generator is None:
        targets = probs_or_greedy.tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == targets[kept]:
            kept += 1
        return targets[:kept + 1]
    probs = probs_or_greedy
    out: list[int] = []
    for i, d in enumerate(drafts):
        if float(probs.new_empty(()).uniform_(generator=generator)) < float(probs[i, d]):
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        out.append(int(residual.multinomial(1, generator=generator)))
        return out
    out.append(int(probs[len(drafts)].multinomial(1, generator=generator)))
    return out


def next_draft_len(drafted: int, kept: int, k: int) -> int:
    """A request's own draft length: one more after a fully kept draft, else one past what was kept,
    so a request whose drafts miss costs one extra row a step, not k."""
    return min(k, drafted + 1) if kept == drafted else kept + 1


class DraftPolicy:
    """How many drafts pay at this batch size, measured as the engine runs (on this CPU, this model).

    A step of M rows takes about a + b*M seconds: `a` the weights streamed once, `b` each row's
    compute. With B requests decoding, a token costs (a + b*B) / B, and a draft row earns its b
    when the chance q_i that a draft at position i is kept beats b*B / (a + b*B). At one request
    that is a low bar; as the batch grows it nears 1 and drafting stops by itself (measured on a Xeon,
    SmolLM2-135M Q4_1: a ~ 8 ms, b ~ 1.5 ms; the bar is 0.16 at one session, 0.6 at eight).
    a and b are a least-squares fit over recent decode steps, q_i the share kept at position i; both
    forget slowly (DECAY per step), so a policy that stopped drafting tries again later."""

    DECAY = 0.995
    PRIOR_ROW_SHARE = 0.2  # b / a before two batch sizes have been seen

    def __init__(self, k: int) -> None:
        self.k = k
        self.proposed = [0.0] * k  # decayed counts of drafts that reached position i
        self.kept = [0.0] * k  # and of those kept
        self._fit = [0.0] * 5  # decayed sums: n, x, y, xx, xy (x rows, y seconds)

    def record_drafts(self, drafted: int, kept: int) -> None:
        for i in range(drafted):
            self.proposed[i] += 1
            self.kept[i] += i < kept

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of decodes only (their drafts included): one point of the cost line."""
        f = self._fit
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            f[i] = f[i] * self.DECAY + v
        self.proposed = [p * self.DECAY for p in self.proposed]
        self.kept = [c * self.DECAY for c in self.kept]

    def cost_line(self) -> tuple[float, float]:
        """(a, b): fixed and per-row seconds of a step; the prior's shape until the rows have varied."""
        n, x, y, xx, xy = self._fit
        if n < 1e-9:
            return 1.0, self.PRIOR_ROW_SHARE
        var = xx / n - (x / n) ** 2
        if var < 0.25:
            per_row_share = self.PRIOR_ROW_SHARE
            a = (y / n) / (1 + per_row_share * x / n)
            return a, a * per_row_share
        b = max((xy / n - (x / n) * (y / n)) / var, 0.0)
        return max(y / n - b * x / n, 1e-9), b

    def max_drafts(self, decoding: int) -> int:
        """Drafts a request may add now: positions whose chance of being kept beats the bar."""
        a, b = self.cost_line()
        bar = b * decoding / (a + b * decoding)
        n = 0
        while n < self.k and (self.kept[n] + 1) / (self.proposed[n] + 1) > bar:
            n += 1
        return n


class SpecCounts:
    """Speculative decoding since start (vLLM's vllm:spec_decode_* counters)."""

    def __init__(self) -> None:
        self.drafts = 0  # requests that drafted, summed over steps
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []  # [i]: drafts at position i kept

    def record(self, drafted: int, kept: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += kept
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(kept):
            self.accepted_per_pos[i] += 1
