"""Continuous batching: one token budget per step, running requests first, then waiting ones.

Not thread-safe: only the engine thread calls it.
"""
from __future__ import annotations

import heapq
import time

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.speculative import DraftPolicy, NgramProposer, SpecCounts, can_draft, next_draft_len, ngram_settings


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.use_priority = config.scheduling_policy == "priority"
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []  # heap by sort key; stale entries skipped
        self.waiting_ids: set[str] = set()
        self.loading: dict[str, Request] = {}  # waiting aside while the disk tier reads their prefix
        self.num_preemptions = 0
        settings = ngram_settings(config.speculative_config)
        self.proposer = NgramProposer(settings) if settings else None
        self.draft_policy = DraftPolicy(settings.num_speculative_tokens) if settings else None
        self.spec = SpecCounts()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_ids) + len(self.loading)

    def _key(self, req: Request) -> tuple:
        return req.sort_key() if self.use_priority else req.sort_key()[1:]

    def add_request(self, req: Request) -> None:
        heapq.heappush(self._waiting, (self._key(req), req))
        self.waiting_ids.add(req.request_id)

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            req = self._waiting[0][1]
            if req.request_id in self.waiting_ids:
                return req
            heapq.heappop(self._waiting)  # aborted while waiting
        return None

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.loading:
            self._requeue_loaded()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._key)  # the preemption victim is always the last one
        max_drafts = self._max_drafts()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, min(budget, max_drafts + 1)) if max_drafts and n == 1 else []
            if drafts and not self.kv.allocate_slots(req, 1 + len(drafts)):
                drafts = []  # no room for them: decode one token (and preempt only for that)
            while not drafts and not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                n += len(drafts)
                out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id), drafts))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.time()
        for s in out.scheduled:
            if s.request.scheduled_time is None:
                s.request.scheduled_time = now
        return out

    def _max_drafts(self) -> int:
        """Drafts per decoding request this step: none while speculation is off, while prompts wait or
        are being computed (draft rows would lengthen the step that gives them their first token:
        measured at 32 sessions, TTFT p50 253 -> 439 ms), or where the draft policy says they do not pay."""
        if self.proposer is None or self.num_waiting:
            return 0
        limit = self.proposer.settings.disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return 0
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if decoding < len(self.running):
            return 0
        return self.draft_policy.max_drafts(decoding)

    def record_step_time(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step of decodes only feeds the draft policy's cost line (rows -> seconds)."""
        if self.draft_policy is not None and all(s.num_tokens - len(s.draft_token_ids) == 1 for s in sched.scheduled):
            self.draft_policy.record_step(sched.num_tokens, seconds)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Speculative tokens for a decoding request: no more than its budget, its max_tokens and the
        context length leave room to keep (each step keeps at most the drafts and one more token)."""
        if not can_draft(req):
            return []
        room = self.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens)
        drafts = self.proposer.propose(req, min(budget, room) - 1)
        if drafts and req.grammar is not None:  # only what the grammar allows is worth a row
            drafts = drafts[:req.grammar.validate_tokens(drafts)]
        return drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                return
            if self.kv.start_disk_load(req):  # its blocks are read off the engine thread; others go on
                heapq.heappop(self._waiting)
                self.waiting_ids.discard(req.request_id)
                self.loading[req.request_id] = req
                continue
            self.kv.adopt_loaded(req)
            hits = self.kv.get_computed_blocks(req)
            num_hit = len(hits) * self.kv.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                if self.use_priority and self.running and self._key(self.running[-1]) > self._key(req):
                    budget += self._preempt(self.running[-1], out)
                    continue
                return
            heapq.heappop(self._waiting)
            self.waiting_ids.discard(req.request_id)
            self.kv.record_lookup(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
            budget -= n

    def _requeue_loaded(self) -> None:
        """Requests whose disk blocks are in memory go back to the queue in their old place."""
        for request_id in self.kv.loaded_requests():
            req = self.loading.pop(request_id, None)
            if req is not None:
                self.add_request(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Preempt by recompute: free the blocks (full ones stay cached), requeue. Returns the
        budget given back if the request had already been scheduled in this step."""
        refund = 0
        for k, s in enumerate(out.scheduled):
            if s.request is req:
                refund = s.num_tokens
                del out.scheduled[k]
                break
        self.running.remove(req)
        self.kv.free(req, written_tokens=req.num_computed_tokens)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.disk_checked = False
        self.num_preemptions += 1
        out.preempted.append(req)
        self.add_request(req)
        return refund

    # ---- after the forward --------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance progress, append sampled tokens, apply token-level stop rules. Returns the
        requests that got a new token (finished ones included)."""
        changed = []
        now = time.time()
        for s in sched.scheduled:
            req, drafted = s.request, len(s.draft_token_ids)
            tokens = result.sampled.get(req.request_id)
            kept = len(tokens) - 1 if drafted and tokens else 0  # rejected drafts' K/V is overwritten later
            req.num_computed_tokens += s.num_tokens - drafted + kept
            if drafted:
                self.spec.record(drafted, kept)
                self.draft_policy.record_drafts(drafted, kept)
                req.num_draft_tokens += drafted
                req.num_accepted_tokens += kept
                req.draft_len = next_draft_len(drafted, kept, self.proposer.settings.num_speculative_tokens)
            if not tokens or req.is_finished:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            for token in tokens:
                req.append_output_token(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish(req, status)
                    break
            if drafted and not req.is_finished:
                self.kv.free_past(req, req.num_tokens)  # blocks that held only rejected drafts
            changed.append(req)
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request in any state and free its blocks at once."""
        if req.is_finished:
            return
        if req.request_id in self.waiting_ids:
            self.waiting_ids.discard(req.request_id)
        elif self.loading.pop(req.request_id, None) is None and req in self.running:
            self.running.remove(req)
        if req.disk_checked:
            self.kv.cancel_disk_load(req.request_id)
        self.kv.free(req)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        req.status = status
        req.finished_time = time.time()

