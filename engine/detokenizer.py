"""Incremental detokenization and stop strings for one request."""
from __future__ import annotations

from transformers import PreTrainedTokenizerFast


def plain_decode(tokenizer):
    """`tokenizer.decode`, or where it adds nothing to its Rust backend's (a fast tokenizer whose
    _decode is the library's and that cleans up no spaces) the backend's own: every request decodes
    twice a step, and transformers' wrapper took twice the decode (SmolLM2, a few tokens: 2.6 -> 0.9 us)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and backend is not None
             and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
             and type(tokenizer).decode is PreTrainedTokenizerFast.decode
             and not getattr(tokenizer, "clean_up_tokenization_spaces", True))
    return backend.decode if plain else tokenizer.decode


class IncrementalDetokenizer:
    """Decodes only the tail of the sequence each step: text from `prefix_offset` is decoded
    again so merges across the boundary (a leading space, a multi-byte character) come out right,
    and nothing is emitted while the tail is an incomplete UTF-8 sequence."""

    CONTEXT = 5  # prompt tokens kept as left context for the first output token

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 stop_strings: list[str], include_stop_str: bool) -> None:
        self.decode = plain_decode(tokenizer)
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.emitted = 0  # characters of self.text already handed out

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string that matched, if any."""
        self.ids.append(token_id)
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        for stop in self.stop_strings:
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[:at + len(stop) if self.include_stop else at]
                return stop
        return None

    def add_tokens(self, token_ids: list[int]) -> tuple[str | None, int]:
        """Append tokens up to the first stop string: (that string or None, how many were taken)."""
        for taken, token_id in enumerate(token_ids, 1):
            stop = self.add(token_id)
            if stop is not None:
                return stop, taken
        return None, len(token_ids)

    def take_delta(self, finished: bool) -> str:
        """New text safe to show: while running, hold back what could start a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
