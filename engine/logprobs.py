"""Log probabilities as requests receive them: the runner scores tokens ({id: (logprob, rank)}),
this turns them into vLLM's Logprob objects with each token's text and keeps them on the request.
Only requests that ask pay for any of it."""
from __future__ import annotations

from functools import lru_cache

from engine.outputs import Logprob, ModelRunnerOutput


class LogprobsRecorder:
    def __init__(self, tokenizer) -> None:
        self._text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def entry(self, scored: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank, self._text(t)) for t, (lp, rank) in scored.items()}

    def record(self, result: ModelRunnerOutput, requests: dict) -> None:
        """Append this step's scores to their requests (`requests`: request_id -> Request)."""
        for request_id, scored in result.logprobs.items():
            req = requests.get(request_id)
            if req is not None:
                req.logprobs.append(self.entry(scored))
        for request_id, (first, entries) in result.prompt_logprobs.items():
            req = requests.get(request_id)
            if req is None:
                continue
            if first == len(req.prompt_logprobs):  # a chunk recomputed after preemption adds nothing
                req.prompt_logprobs.extend(self.entry(e) for e in entries)
