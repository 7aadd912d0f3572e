"""What constrains a request's next token beyond sampling. Structured outputs on llguidance: a JSON
schema, regex, choice or Lark grammar becomes a matcher that, each step, says which tokens may come
next (a bitmask applied to that request's row of logits in the batched sampler) and then consumes
the token sampled; free requests in the same batch are untouched. And bad_words as token sequences."""
from __future__ import annotations

import functools
import json
import re

import torch

from engine.errors import ParameterError
from engine.sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """One per model: the llguidance view of its tokenizer is built on first use (~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._lltokenizer = None

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher for one request, or ValueError saying what is wrong with the grammar."""
        import llguidance
        import llguidance.hf

        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=list(self.eos_token_ids) or None)
        M = llguidance.LLMatcher
        if spec.json is not None:
            grammar = M.grammar_from_json_schema(json.dumps(spec.json))
        elif spec.json_object:
            grammar = M.grammar_from_json_schema(json.dumps({"type": "object"}))
        elif spec.regex is not None:
            grammar = M.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = M.grammar_from_regex("|".join(f"({re.escape(c)})" for c in spec.choice))
        else:
            grammar = M.grammar_from_lark(spec.grammar)
        problem = M.validate_grammar(grammar, self._lltokenizer)
        if problem:
            raise ParameterError(f"structured_outputs: {problem.strip()}", "structured_outputs")
        matcher = M(self._lltokenizer, grammar)
        if matcher.is_error():
            raise ParameterError(f"structured_outputs: {matcher.get_error()}", "structured_outputs")
        return matcher


@functools.cache
def _ceilings(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each value of a mask byte, its 8 tokens' ceilings (+inf allowed, -inf not)."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, float("inf"), float("-inf")).to(device, dtype)


def _keep_allowed(logits: torch.Tensor, bitmasks: list[bytes]) -> None:
    """Row i of `logits` (in place) keeps the tokens bitmasks[i] allows (a matcher's compute_bitmask():
    little-endian 32-bit words, so bit j of byte b is token 8b + j); the rest become -inf, ids past
    the tokenizer's too. Each byte picks its 8 tokens' ceilings from a table and the row takes the
    minimum: 0.3 ms for 16 rows of 49152 where masked_fill_ took 1.9. We do this rather than import
    llguidance.torch, whose helper is a torch.compile kernel: ~3 s of imports (dynamo) and a compile
    on the first constrained request of a process."""
    data = torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.uint8).to(logits.device)
    limits = _ceilings(logits.device, logits.dtype).index_select(0, data.int()).view(len(bitmasks), -1)
    n = min(logits.shape[-1], limits.shape[1])
    known = logits[:, :n]  # the ids the tokenizer has
    torch.minimum(known, limits[:, :n], out=known)
    logits[:, n:] = float("-inf")


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> None:
    """Rows with a matcher keep only the tokens their grammar allows next; rows with None are free."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    constrained = logits[rows]
    _keep_allowed(constrained, [matchers[i].compute_bitmask() for i in rows])
    logits[rows] = constrained


def apply_draft_masks(logits: torch.Tensor, matcher, drafts: list[int]) -> None:
    """A drafting request's rows [1 + len(drafts), V]: row i keeps the tokens the grammar allows after
    drafts[:i] (consumed in turn, then rolled back: the matcher ends as it began). Rows after a draft
    the grammar refuses are left free: that draft is rejected at its own row, so they are never used."""
    valid, consumed, bitmasks = matcher.validate_tokens(drafts), 0, []
    try:
        for i in range(valid + 1):
            bitmasks.append(matcher.compute_bitmask())
            if i < valid:
                matcher.consume_token(drafts[i])
                consumed += 1
    finally:
        matcher.rollback(consumed)
    _keep_allowed(logits[:valid + 1], bitmasks)


def consume_reply_tokens(matcher, tokens: list[int], eos_token_ids) -> tuple[str | None, int]:
    """The grammar consumes a step's new tokens (several when drafts were kept): ("error", i) when token
    i is not allowed, ("stopped", i) when token i completes it, else (None, len(tokens)). EOS is not
    consumed: the mask only let it through where the grammar may end."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            break
        if not matcher.consume_token(token):
            return "error", i
        if matcher.is_stopped():
            return "stopped", i
    return None, len(tokens)


def bad_word_sequences(tokenizer, words: list[str] | None) -> list[list[int]]:
    """Each word as the token sequences that spell it, alone and after a space (as vLLM does)."""
    sequences = []
    for word in words or []:
        for text in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
