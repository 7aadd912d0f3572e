"""The narrow types that cross layers: scheduler -> runner -> engine -> callers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # rows computed for it this step (1 for decode, a chunk for prefill, 1 + drafts)
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens after its last one

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a new one is sampled."""
        known = self.num_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decode_tokens(self) -> int:
        """Rows that compute an output token (a decode, with its drafts), as scheduled: before the
        step's update moves the requests' progress."""
        return sum(s.num_tokens for s in self.scheduled if s.num_tokens - len(s.draft_token_ids) == 1
                   and s.request.num_computed_tokens >= s.request.num_prompt_tokens)


@dataclass
class ModelRunnerOutput:
    # request_id -> its new token ids (requests that sample): one, or with drafts the kept ones and one more
    sampled: dict[str, list[int]]
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why its sampling failed
    # request_id -> {token id: (logprob, rank)} for the sampled token and the top-N (requests that ask)
    logprobs: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    # request_id -> (first prompt position scored, one such dict per prompt token of this step's chunk)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, tuple[float, int]]]]] = field(default_factory=dict)


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank among all tokens (1 = the likeliest), its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    max_tokens: int | None = None  # what the request asked for (vllm:request_max_num_generation_tokens)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for it, and kept
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per token, when SamplingParams.logprobs is set
    # LLM.chat(tools=...) only: the reply read as OpenAI's message (text without the calls, and the calls)
    content: str | None = None
    tool_calls: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # Streaming deltas: what this step added (the full text/token_ids are in outputs[0]).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None, as vLLM


class ChoiceCollector:
    """The newest CompletionOutput of each choice (n > 1 streams them interleaved, one per output);
    whole() is the last RequestOutput with every choice, in index order."""

    def __init__(self) -> None:
        self.latest: dict[int, CompletionOutput] = {}
        self.last: RequestOutput | None = None
        self.prompt_logprobs = None  # the leader's (n > 1: the sample that computed the prompt)

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        for choice in out.outputs:
            self.latest[choice.index] = choice

    def whole(self) -> RequestOutput:
        return dataclasses.replace(self.last, outputs=[self.latest[i] for i in sorted(self.latest)],
                                   prompt_logprobs=self.prompt_logprobs)


@dataclass
class EngineStats:
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0  # free but still holding a hashed prefix
    kv_blocks_free: int = 0  # free and empty
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0
    prefill_tokens_total: int = 0  # rows computed for prompts (prefix-cache hits are not computed)
    decode_tokens_total: int = 0  # rows computed for decodes, speculative drafts included
    last_batch_size: int = 0
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0
    kv_disk_capacity_bytes: int = 0  # 0: no disk tier
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_queries: int = 0  # tokens looked up on disk past the pool's hit
    kv_disk_hits: int = 0  # tokens loaded back from disk
    kv_disk_read_bytes: int = 0
    kv_disk_written_bytes: int = 0
    kv_disk_corrupt_files: int = 0
    kv_disk_dropped_writes: int = 0
    spec_decode_num_drafts: int = 0  # speculative decoding (engine/speculative.py): vLLM's counters
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)

    def record_step(self, sched, decode_tokens: int, num_sampled: int) -> None:
        self.num_steps += 1
        self.last_batch_size = len(sched.scheduled)
        self.last_decode_tokens = decode_tokens
        self.last_prefill_tokens = sched.num_tokens - decode_tokens
        self.prefill_tokens_total += self.last_prefill_tokens
        self.decode_tokens_total += decode_tokens
        self.generation_tokens_total += num_sampled

    def record_disk(self, disk, queries: int, hits: int) -> None:
        """Copy the disk tier's counters (a DiskStats)."""
        self.kv_disk_capacity_bytes, self.kv_disk_blocks, self.kv_disk_bytes = (
            disk.capacity_bytes, disk.blocks, disk.bytes)
        self.kv_disk_queries, self.kv_disk_hits = queries, hits
        self.kv_disk_read_bytes, self.kv_disk_written_bytes = disk.read_bytes, disk.written_bytes
        self.kv_disk_corrupt_files, self.kv_disk_dropped_writes = disk.corrupt_files, disk.dropped_writes

    def record_spec(self, spec) -> None:
        """Copy the scheduler's speculation counters (a SpecCounts)."""
        self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens = spec.drafts, spec.draft_tokens
        self.spec_decode_num_accepted_tokens = spec.accepted_tokens
        self.spec_decode_accepted_per_pos = list(spec.accepted_per_pos)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
