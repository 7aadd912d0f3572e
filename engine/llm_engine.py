"""The synchronous core: add_request / abort / step (the offline `LLM` API is in engine/llm.py).

LLMEngine is not thread-safe: one thread owns it (the async front runs it on its own thread).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psutil
import torch

from engine.checkpoint.load import build_model, quant_spec
from engine.checkpoint.source import load_config_and_tokenizer, resolve_model, sampling_defaults
from engine.client import ContextLengthError, EngineOverloadedError, ModelInfo
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.quant.kernels import weight_bytes
from engine.quant.choices import choose_mode
from engine.quant.methods import quantize_model
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, ScheduledRequest
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

log = logging.getLogger("pagedchat.engine")

MAX_DEFAULT_MODEL_LEN = 8192
CPU_KV_CAP_BYTES = 2 << 30


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    outputs_sent: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.resolved_threads())
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        t0 = time.perf_counter()
        self.source = resolve_model(config.model)
        self.hf_config, self.tokenizer = load_config_and_tokenizer(self.source)
        self.max_model_len = self._resolve_max_model_len()
        spec = quant_spec(self.source, self.hf_config)
        self.quantization = choose_mode(config.quantization, spec, self.source.kind, self.dtype)
        packs = self.quantization in ("gguf", getattr(spec, "method", None))  # 4-bit layers stay 4-bit
        self.model, packed = build_model(self.source, self.hf_config, self.dtype, self.device,
                                         self.max_model_len, keep_packed=packs)
        if "dequantized" in self.quantization:
            log.info("%s checkpoint dequantized to %s at load (the int4 kernels take bf16)", spec.method, self.dtype)
        else:
            quantize_model(self.model, self.quantization, self.dtype, packed)
        self.weight_bytes = weight_bytes(self.model)
        num_blocks = self._num_kv_blocks()
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV cache "
                                 f"({num_blocks} blocks x {config.block_size} = {capacity} tokens)")
            self.max_model_len = capacity
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype, self.device, config.seed)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.load_seconds = time.perf_counter() - t0
        self.eos_token_ids = self._eos_ids()
        self.sampling_defaults, self.sampling_source = sampling_defaults(self.source)  # read once
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[RequestOutput] = []  # outputs made outside step() (aborts)
        self._counter = 0
        self.stats = EngineStats(kv_blocks_total=num_blocks, block_size=config.block_size)
        log.info("loaded %s (%s, %s, quantization %s, %d threads) in %.1fs: weights %.0f MiB, %d KV blocks "
                 "of %d tokens (%.0f MiB), max_model_len %d", self.source.name, self.device,
                 str(self.dtype).removeprefix("torch."), self.quantization, torch.get_num_threads(),
                 self.load_seconds, self.weight_bytes / 2**20, num_blocks, config.block_size,
                 self.runner.kv_cache_bytes / 2**20, self.max_model_len)

    # ---- setup --------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
        if self.config.max_model_len is None:
            return min(model_max, MAX_DEFAULT_MODEL_LEN)
        if self.config.max_model_len > model_max:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        return self.config.max_model_len

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = ModelRunner.bytes_per_block(self.model, c.block_size, self.dtype)
        budget = c.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.5)
            else:
                budget = min(int(psutil.virtual_memory().available * 0.25), CPU_KV_CAP_BYTES)
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes {budget} holds fewer than 2 blocks of {per_block} bytes")
        return blocks

    def _eos_ids(self) -> tuple[int, ...]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

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
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens but max_model_len is {self.max_model_len} "
                                     f"(the prompt plus at least one generated token must fit)", "prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}, got {params.stop_token_ids}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id is None:
            request_id, self._counter = str(self._counter), self._counter + 1
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise EngineOverloadedError(f"engine overloaded: {self.scheduler.num_waiting} requests waiting "
                                        f"(max_waiting={self.config.max_waiting})")
        req = Request(request_id, ids, params, prompt=text, priority=priority,
                      eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, session_id=session_id)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                       params.stop_strings, params.include_stop_str_in_output)
        self._tracked[request_id] = _Tracked(req, detok)
        self.stats.prompt_tokens_total += len(ids)
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; its final output says "abort"."""
        t = self._tracked.get(request_id)
        if t is None:
            return False
        self.scheduler.finish(t.request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(self._finalize(t))
        return True

    def session_of(self, request_id: str) -> str | None:
        t = self._tracked.get(request_id)
        return t.request.session_id if t else None

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # ---- one iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(sched)
        except Exception as e:  # a failed forward fails its requests, never the engine
            log.exception("step failed")
            self.kv.reset_prefix_cache()  # blocks registered for this step may hold unwritten K/V
            for s in sched.scheduled:
                t = self._tracked.get(s.request.request_id)
                if t is not None:
                    t.request.error = f"{type(e).__name__}: {e}"
                    self.scheduler.finish(t.request, RequestStatus.FINISHED_ERROR)
                    outputs.append(self._finalize(t))
            return outputs
        changed = self.scheduler.update(sched, result)
        for request_id, why in result.failed.items():  # its own fault: the batch and the cache go on
            t = self._tracked.get(request_id)
            if t is not None:
                log.warning("request %s failed: %s", request_id, why)
                t.request.error = why
                self.scheduler.finish(t.request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._finalize(t))
        for req in changed:
            t = self._tracked[req.request_id]
            stop = t.detok.add(req.output_token_ids[-1])
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            outputs.append(self._finalize(t) if req.is_finished else self._make_output(t))
        self._record_step(sched, len(changed), time.perf_counter() - t0)
        return outputs

    def _record_step(self, sched, num_sampled: int, seconds: float) -> None:
        s = self.stats
        decode = sum(1 for x in sched.scheduled if x.num_tokens == 1
                     and x.request.num_computed_tokens - 1 >= x.request.num_prompt_tokens)
        s.num_steps += 1
        s.last_batch_size = len(sched.scheduled)
        s.last_decode_tokens = decode
        s.last_prefill_tokens = sched.num_tokens - decode
        s.last_step_seconds = seconds
        s.generation_tokens_total += num_sampled

    def _make_output(self, t: _Tracked) -> RequestOutput:
        req = t.request
        finished = req.is_finished
        delta_text = t.detok.take_delta(finished)
        delta_ids = req.output_token_ids[t.outputs_sent:]
        t.outputs_sent = req.num_output_tokens
        text = t.detok.text if finished else t.detok.text[:t.detok.emitted]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(req.output_token_ids),
                                      req.status.value if finished else None, req.stop_reason)],
            finished=finished, num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=RequestMetrics(req.arrival_time, req.scheduled_time, req.first_token_time, req.finished_time),
            error=req.error, delta_text=delta_text, delta_token_ids=delta_ids)

    def _finalize(self, t: _Tracked) -> RequestOutput:
        self._tracked.pop(t.request.request_id, None)
        self.runner.sampler.forget(t.request.request_id)
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
        return EngineStats(**s.__dict__)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def model_info(self, model: str | None) -> ModelInfo:
        return ModelInfo(self.source.name, model, self.tokenizer, self.max_model_len, self.hf_config.vocab_size,
                         str(self.device), str(self.dtype).removeprefix("torch."), self.quantization,
                         self.sampling_defaults, self.sampling_source)

    def mean_nll(self, token_ids: list[int]) -> float:
        """Mean negative log-likelihood of a token sequence under the model (quality checks), from
        one prefill through the paged cache; the engine must be idle."""
        if self.has_unfinished_requests():
            raise RuntimeError("mean_nll needs an idle engine")
        req = Request("score", token_ids, SamplingParams())
        if not self.kv.allocate_slots(req, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit the KV cache")
        try:
            logits = self.runner.logits_for_all(ScheduledRequest(req, len(token_ids), self.kv.block_ids("score")))
        finally:
            self.kv.free(req)
        targets = torch.tensor(token_ids[1:], device=logits.device)
        return torch.nn.functional.cross_entropy(logits[:-1].float(), targets).item()

    def check_integrity(self) -> None:
        self.kv.pool.check_integrity()
        if not self.has_unfinished_requests() and self.kv.pool.num_used:
            raise AssertionError(f"{self.kv.pool.num_used} blocks in use with no request alive")

