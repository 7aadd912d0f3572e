"""Request: the engine's record of one generation, with a single progress counter."""
from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.penalties import SeenTokens


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


_arrival_counter = itertools.count()


class Request:
    """`num_computed_tokens` is the one progress counter: prompt chunks, prefix-cache hits,
    decode steps and recompute after preemption all move (or reset) it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, prompt: str | None = None, priority: int = 0, eos_token_ids: tuple[int, ...] = (),
                 cache_salt: str | None = None, session_id: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.session_id = session_id  # a label only: which conversation this request belongs to
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set at first scheduling: prefix-cache hit in tokens
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.num_saved_blocks = 0  # full blocks already handed to the disk tier
        self.disk_checked = False  # looked for its prefix in the disk tier since it was last queued
        self.arrival_seq = next(_arrival_counter)  # tie-break for equal arrival times
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.grammar = None  # an llguidance matcher when the request asks for structured output
        self.bad_words_ids: list[list[int]] = []  # token sequences never to complete
        self.logprobs: list[dict] = []  # per output token: id -> Logprob (when params.logprobs is set)
        # per prompt token (when params.prompt_logprobs is set), the first None: nothing scores it
        self.prompt_logprobs: list[dict | None] = [None] if params.prompt_logprobs is not None else []
        self.draft_len = 0  # speculative decoding: drafts to propose at most (0: the configured k)
        self.num_draft_tokens = 0  # drafts verified for it, and how many of them were kept
        self.num_accepted_tokens = 0
        self.seen_tokens: SeenTokens | None = None  # its distinct ids, for the repetition penalty

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (a stop string met inside the
        tokens one step accepted: what follows it is not part of the reply)."""
        extra = self.num_output_tokens - num_output_tokens
        if extra > 0:
            del self.output_token_ids[-extra:]
            del self.all_token_ids[-extra:]
            self.seen_tokens = None

    def sort_key(self) -> tuple[int, float, int]:
        """(priority, arrival): lower runs first; the victim of a preemption is the largest."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}"
                f"/{self.num_tokens})")
