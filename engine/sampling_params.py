"""SamplingParams: vLLM's names, defaults and validation. temperature == 0 means greedy."""
from __future__ import annotations

from dataclasses import dataclass, field

_EPS = 1e-5
_INF = float("inf")


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
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        check(isinstance(self.n, int) and self.n == 1, "n", "must be 1 (parallel sampling is not supported)")
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
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}.")
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
