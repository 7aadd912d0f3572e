"""The synchronous core: add_request / abort / step (the offline `LLM` API is in engine/llm.py).

LLMEngine is not thread-safe: one thread owns it (the async front runs it on its own thread).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.client import ContextLengthError, EngineOverloadedError, ModelInfo
from engine.config import EngineConfig, kv_disk_folder
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ParameterError
from engine.kv_cache_manager import KVCacheManager
from engine.kv_disk import open_disk_tier
from engine.loader import load
from engine.logprobs import LogprobsRecorder
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.parallel import Family, child_params, fork
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sizing import eos_token_ids, fit_to_pool, num_kv_blocks
from engine.structured import GrammarCompiler, bad_word_sequences, consume_reply_tokens

log = logging.getLogger("pagedchat.engine")


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    outputs_sent: int = 0
    family: Family | None = None  # n > 1: the request this sequence is one sample of
    index: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.resolved_threads())  # for the load; the runner sets its own at each step
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        t0 = time.perf_counter()
        loaded = load(config, dtype=self.dtype, device=self.device)
        self.source, self.hf_config, self.tokenizer, self.model = (loaded.source, loaded.hf_config, loaded.tokenizer,
                                                                   loaded.model)
        self.quantization, self.quantization_shown = loaded.quantization, loaded.quantization_shown
        self.weight_bytes, self.max_model_len = loaded.weight_bytes, loaded.max_model_len
        self.sampling_defaults, self.sampling_source = loaded.sampling_defaults, loaded.sampling_source
        block_bytes = ModelRunner.bytes_per_block(self.model, config.block_size, self.dtype, config.kv_cache_dtype)
        num_blocks = num_kv_blocks(config, block_bytes, self.device)
        self.max_model_len = fit_to_pool(self.max_model_len, config.max_model_len, num_blocks, config.block_size)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype, self.device, config.seed,
                                  config.logprobs_mode, config.resolved_threads(), config.kv_cache_dtype,
                                  cascade=not config.batch_invariant)
        windows = [layer.window for layer in self.model.attention_layers()]
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 min(windows) if windows and None not in windows else None)
        if config.kv_disk:
            store = open_disk_tier(kv_disk_folder(config.kv_disk), config.kv_disk_bytes, loaded.identity,
                                   self.runner.k_cache)
            self.kv.attach_disk(store, self.runner)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.load_seconds = time.perf_counter() - t0
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.logprobs = LogprobsRecorder(self.tokenizer)
        self._tracked: dict[str, _Tracked] = {}
        self._families: dict[str, Family] = {}  # requests with n > 1, by their id
        self._pending: list[RequestOutput] = []  # outputs made outside step() (aborts)
        self._counter = 0
        self.stats = EngineStats(kv_blocks_total=num_blocks, block_size=config.block_size)
        log.info("loaded %s (%s, %s, quantization %s, %d threads) in %.1fs: weights %.0f MiB, %d KV blocks "
                 "of %d tokens (%.0f MiB, %s), max_model_len %d", self.source.name, self.device,
                 str(self.dtype).removeprefix("torch."), self.quantization_shown, torch.get_num_threads(),
                 self.load_seconds, self.weight_bytes / 2**20, num_blocks, config.block_size,
                 self.runner.kv_cache_bytes / 2**20, config.kv_cache_dtype, self.max_model_len)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    session_id: str | None = None) -> str:
        """Admit a request or refuse it with a ValueError (ContextLengthError for a prompt that does
        not fit) or EngineOverloadedError. `session_id` only labels it (the panel's page owners)."""
        params = params or SamplingParams()
        vocab = self.hf_config.vocab_size
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ParameterError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if not ids:
            raise ParameterError("prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens but max_model_len is {self.max_model_len} "
                                     f"(the prompt plus at least one generated token must fit)", "prompt")
        for field, named in params.token_ids_used().items():
            outside = [t for t in named if t >= vocab]
            if outside:
                raise ParameterError(f"{field} must name token ids below the vocabulary size {vocab}, "
                                     f"got {outside[:5]}", field)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParameterError(f"priority must be an integer, got {priority!r}", "priority")
        if request_id is None:
            request_id, self._counter = str(self._counter), self._counter + 1
        if request_id in self._tracked:
            raise ParameterError(f"request_id {request_id!r} is already in use", "request_id")
        if params.n > self.config.max_num_seqs:
            raise ParameterError(f"n must be at most max_num_seqs ({self.config.max_num_seqs}), got {params.n}", "n")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise EngineOverloadedError(f"engine overloaded: {self.scheduler.num_waiting} requests waiting "
                                        f"(max_waiting={self.config.max_waiting})")
        family = Family(request_id, params.n, {request_id}) if params.n > 1 else None
        req = Request(request_id, ids, child_params(params, 0) if family else params, prompt=text,
                      priority=priority, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, session_id=session_id)
        self._admit(req)
        self._track(req, family, 0)
        if family:
            self._families[request_id] = family
        self.stats.prompt_tokens_total += len(ids)
        self.scheduler.add_request(req)
        return request_id

    def _admit(self, req: Request) -> None:
        """What a sequence needs besides its tokens: its bad words and grammar (ValueError if bad)."""
        req.bad_words_ids = bad_word_sequences(self.tokenizer, req.params.bad_words)
        if req.params.structured_outputs is not None:
            req.grammar = self.grammars.matcher(req.params.structured_outputs)

    def _track(self, req: Request, family: Family | None, index: int) -> None:
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens, p.stop_strings,
                                       p.include_stop_str_in_output)
        self._tracked[req.request_id] = _Tracked(req, detok, family=family, index=index)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request (all its samples) now and free its blocks; its final output says "abort"."""
        family = self._families.get(request_id)
        if family is not None:
            family.forked = True  # no more siblings
        members = sorted(family.live) if family else [request_id]
        tracked = [self._tracked[m] for m in members if m in self._tracked]
        for t in tracked:
            self.scheduler.finish(t.request, RequestStatus.FINISHED_ABORTED)
            self._pending.append(self._finalize(t))
        return bool(tracked)

    def session_of(self, request_id: str) -> str | None:
        t = self._tracked.get(request_id)
        return t.request.session_id if t else None

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or finished ones (aborted between steps) whose final output the
        next step() has yet to return: a caller that stops stepping when this is False loses none."""
        return bool(self._tracked or self._pending)

    # ---- one iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.loading:  # nothing to run until the disk tier has read a prefix
                self.kv.wait_for_disk(timeout=0.05)
            return outputs
        decode_tokens = sched.num_decode_tokens
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # a failed forward fails its requests, never the engine
            log.exception("step failed")
            self.kv.reset_prefix_cache()  # blocks registered for this step may hold unwritten K/V
            outputs += [self._fail(t, f"{type(e).__name__}: {e}") for s in sched.scheduled
                        if (t := self._tracked.get(s.request.request_id)) is not None]
            return outputs
        self.kv.save_computed(sched.scheduled)
        if self._families:
            self._fork_families(sched)
        changed = self.scheduler.update(sched, result)
        if result.logprobs or result.prompt_logprobs:
            self.logprobs.record(result, {s.request.request_id: s.request for s in sched.scheduled})
        for request_id, why in result.failed.items():  # its own fault: the batch and the cache go on
            if (t := self._tracked.get(request_id)) is not None:
                log.warning("request %s failed: %s", request_id, why)
                outputs.append(self._fail(t, why))
        new_tokens = 0
        for req in changed:
            t = self._tracked[req.request_id]
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(t)
            stop, taken = t.detok.add_tokens(req.output_token_ids[t.outputs_sent:])  # several: kept drafts
            req.truncate_output(t.outputs_sent + taken)  # a stop string ends the reply at its token
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            new_tokens += taken
            outputs.append(self._finalize(t) if req.is_finished else self._make_output(t))
        seconds = time.perf_counter() - t0
        self.scheduler.record_step_time(sched, seconds)
        self.stats.record_step(sched, decode_tokens, new_tokens)
        return outputs

    def _fail(self, t: _Tracked, why: str) -> RequestOutput:
        t.request.error = why
        self.scheduler.finish(t.request, RequestStatus.FINISHED_ERROR)
        return self._finalize(t)

    def _fork_families(self, sched) -> None:
        """Leaders (n > 1) whose prompt this step completed fork their siblings, before anything frees it."""
        for s in sched.scheduled:
            family = self._families.get(s.request.request_id)
            if family and not family.forked and s.samples and s.request.num_output_tokens == 0:
                siblings = fork(s.request, family, self.kv, self.runner, self.scheduler, self.config.max_num_seqs,
                                self._admit)
                for index, child in enumerate(siblings, 1):
                    self._track(child, family, index)

    def _advance_grammar(self, t: _Tracked) -> None:
        """The grammar consumes the step's tokens; once complete, the request stops there."""
        req = t.request
        outcome, at = consume_reply_tokens(req.grammar, req.output_token_ids[t.outputs_sent:], req.eos_token_ids)
        if outcome == "error":
            req.error = f"structured output: {req.grammar.get_error() or 'token not allowed by the grammar'}"
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        elif outcome == "stopped":
            req.truncate_output(t.outputs_sent + at + 1)
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def _make_output(self, t: _Tracked) -> RequestOutput:
        req, family = t.request, t.family
        finished = req.is_finished
        delta_text = t.detok.take_delta(finished)
        delta_ids = req.output_token_ids[t.outputs_sent:]
        t.outputs_sent = req.num_output_tokens
        text = t.detok.text if finished else t.detok.text[:t.detok.emitted]
        return RequestOutput(
            request_id=family.request_id if family else req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(t.index, text, list(req.output_token_ids),
                                      req.status.value if finished else None, req.stop_reason,
                                      list(req.logprobs) if req.params.logprobs is not None else None)],
            finished=finished and (family is None or (family.forked and not family.live)),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=RequestMetrics(req.arrival_time, req.scheduled_time, req.first_token_time, req.finished_time,
                                   req.params.max_tokens, req.num_draft_tokens, req.num_accepted_tokens),
            error=req.error, delta_text=delta_text, delta_token_ids=delta_ids,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None)

    def _finalize(self, t: _Tracked) -> RequestOutput:
        self._tracked.pop(t.request.request_id, None)
        self.runner.sampler.forget(t.request.request_id)
        if t.family is not None:
            t.family.live.discard(t.request.request_id)
            if t.index == 0 and not t.family.forked:  # ended before its prompt was done: no siblings
                t.family.forked = True
            if not t.family.live and t.family.forked:
                self._families.pop(t.family.request_id, None)
        return self._make_output(t)

    # ---- introspection ------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s, pool = self.stats, self.kv.pool
        s.kv_blocks_used = pool.num_used
        s.kv_blocks_cached = pool.num_cached_free
        s.kv_blocks_free = pool.num_free - s.kv_blocks_cached
        s.num_running = len(self.scheduler.running)
        s.num_waiting = self.scheduler.num_waiting
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        s.record_spec(self.scheduler.spec)
        disk = self.kv.disk_stats()
        if disk is not None:
            s.record_disk(disk, self.kv.disk_queries, self.kv.disk_hits)
        return EngineStats(**s.__dict__)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop its threads (the engine is unusable after)."""
        self.kv.close()

    def model_info(self, model: str | None) -> ModelInfo:
        return ModelInfo(self.source.name, model, self.tokenizer, self.max_model_len, self.hf_config.vocab_size,
                         str(self.device), str(self.dtype).removeprefix("torch."), self.quantization_shown,
                         self.sampling_defaults, self.sampling_source, self.config.block_size,
                         self.config.enable_prefix_caching)

    def check_integrity(self) -> None:
        self.kv.pool.check_integrity()
        if not self.has_unfinished_requests() and self.kv.pool.num_used:
            raise AssertionError(f"{self.kv.pool.num_used} blocks in use with no request alive")

