"""SamplingParams: vLLM's names, defaults and validation. temperature == 0 means greedy."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.errors import ParameterError

_EPS = 1e-5
_INF = float("inf")
MAX_LOGPROBS = 20
MAX_N = 64  # parallel samples of one request


@dataclass
class StructuredOutputsParams:
    """vLLM's: exactly one of a JSON schema (`json`, a dict or its text), any JSON object
    (`json_object`), a regular expression, a choice among strings, or a Lark grammar."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ParameterError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                                 f"got {given or 'none'}.", "structured_outputs")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ParameterError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}.",
                                 "structured_outputs.choice")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ParameterError(f"structured_outputs.json is not valid JSON: {e}",
                                     "structured_outputs.json") from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # per generated token: the sampled token's and the top-N log probabilities
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (every token sequence that spells one)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.temperature < _EPS:
            # Greedy: the other knobs cannot change the argmax (penalties still apply).
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ParameterError(f"{name} {msg}, got {getattr(self, name)!r}.", name)

        check(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_N, "n",
              f"must be an integer in [1, {MAX_N}]")
        check(_is_number(self.temperature) and 0 <= self.temperature < _INF, "temperature", "must be a finite number >= 0")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), "top_k",
              "must be -1 or 0 (disabled) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}.",
                                 "min_tokens")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                    and -2**63 <= self.seed < 2**64), "seed", "must be an integer in [-2**63, 2**64)")
        check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < _INF, "repetition_penalty",
              "must be a finite number > 0")
        check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
              "must be in [-2, 2]")
        check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
              "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                    and 0 <= value <= MAX_LOGPROBS), name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and _is_number(b) and abs(b) < _INF for t, b in self.logit_bias.items()),
                "logit_bias", "must map token ids to finite numbers")
            self.logit_bias = {t: max(-100.0, min(100.0, float(b))) for t, b in self.logit_bias.items()}
        check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                 and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
              "allowed_token_ids", "must be a non-empty list of token ids")
        check(self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
              "must be non-empty strings")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def masks_logits(self) -> bool:
        """Whether something besides penalties changes this request's logits before sampling."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured_outputs)

    def token_ids_used(self) -> dict[str, list[int]]:
        """The token ids each field names (the engine checks them against the vocabulary)."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or {}),
                "allowed_token_ids": list(self.allowed_token_ids or [])}

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
