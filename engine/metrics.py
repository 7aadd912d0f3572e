"""Prometheus collectors under vLLM's metric names, fed with facts from the engine thread.

The engine emits facts (stats counters, request timestamps); this module turns them into series.
Every labelled series is created at start so dashboards never see "no data" before traffic.
"""
from __future__ import annotations

import logging
import time

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import ProcessCollector

from engine.outputs import EngineStats, RequestOutput

log = logging.getLogger("pagedchat.metrics")

FINISH_REASONS = ("stop", "length", "abort", "error")
_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)  # vLLM's 1-2-5 steps


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        labels = ["model_name"]
        self.model_name = model_name

        plain = []  # series labelled by model only: created now, so they exist from the first scrape

        def make(cls, name, doc, extra=(), **kw):
            metric = cls(name, doc, labels + list(extra), registry=r, **kw)
            if not extra:
                plain.append(metric)
            return metric

        def gauge(name, doc, extra=()):
            return make(Gauge, name, doc, extra)

        def counter(name, doc, extra=()):
            return make(Counter, name, doc, extra)

        def histogram(name, doc, buckets):
            return make(Histogram, name, doc, buckets=buckets)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions by the scheduler")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.success = counter("vllm:request_success", "Finished requests by finish reason", ["finished_reason"])
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step", _TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        # per finished request, as vLLM v1 (its reference Grafana dashboard reads these)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                               _REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request",
                                                   _REQUEST_TOKEN_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_max_num_generation_tokens",
                                            "The max_tokens each request asked for", _REQUEST_TOKEN_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to finish", _LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to finish",
                                        _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Decode time over the tokens after the first, per request", _ITL_BUCKETS)
        # the names older vLLM dashboards (and its example dashboard) still query
        self.tpot_legacy = histogram("vllm:time_per_output_token_seconds", "As vllm:request_time_per_output_token_"
                                     "seconds (the older name)", _ITL_BUCKETS)
        self.kv_usage_legacy = gauge("vllm:gpu_cache_usage_perc", "As vllm:kv_cache_usage_perc (the older name)")
        self.kv_blocks = gauge("pagedchat:kv_blocks", "KV blocks by state", ["state"])
        self.kv_blocks_total = gauge("pagedchat:kv_blocks_total", "KV blocks in the pool")
        self.batch_size = histogram("pagedchat:batch_size", "Requests per engine step", _TOKEN_BUCKETS)
        self.load_seconds = gauge("pagedchat:model_load_seconds", "Seconds the model took to load")
        self.rss = gauge("pagedchat:resident_memory_bytes", "Resident memory of the process")
        self.weight_bytes = gauge("pagedchat:weight_bytes", "Bytes of model weights")
        self.kv_cache_bytes = gauge("pagedchat:kv_cache_bytes", "Bytes of the KV block pool")
        self.cache_config = gauge("vllm:cache_config_info", "Information of the KV cache's configuration (value 1)",
                                  ["block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"])
        self.disk_queries = counter("vllm:external_prefix_cache_queries",
                                    "Prompt tokens looked up in the KV disk tier (past the pool's hit)")
        self.disk_hits = counter("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the KV disk tier")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts verified (a request's, per step)")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens kept")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens kept, by their position in the draft", ["position"])
        self.request_acceptance = histogram("pagedchat:request_spec_decode_acceptance_rate",
                                            "Per request that drafted: the share of its draft tokens kept",
                                            _RATE_BUCKETS)
        self.disk_blocks = gauge("pagedchat:kv_disk_blocks", "KV blocks stored in the disk tier")
        self.disk_bytes = gauge("pagedchat:kv_disk_bytes", "Bytes of the disk tier's files")
        self.disk_capacity = gauge("pagedchat:kv_disk_capacity_bytes", "Size bound of the disk tier (0: off)")
        self.disk_read = counter("pagedchat:kv_disk_read_bytes", "Bytes read back from the disk tier")
        self.disk_written = counter("pagedchat:kv_disk_written_bytes", "Bytes written to the disk tier")
        self.disk_corrupt = counter("pagedchat:kv_disk_corrupt_files", "Disk-tier files that failed their checks")
        self.disk_dropped = counter("pagedchat:kv_disk_dropped_writes", "Blocks not saved: the writer was behind or the disk refused")
        self.healthy = gauge("pagedchat:engine_healthy", "1 when the engine loop is serving")
        self.load_failures = counter("pagedchat:model_load_failures", "Model loads that failed")
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for state in ("used", "cached", "free"):
            self.kv_blocks.labels(model_name, state)
        for metric in plain:
            metric.labels(model_name)
        self._last = EngineStats()
        self._last_token_time: dict[str, float] = {}
        self._last_log = 0.0
        self._window = (time.monotonic(), 0)  # (start, generation tokens at start) for the log line
        self._process = psutil.Process()

    def _l(self, metric, *extra):
        return metric.labels(self.model_name, *extra)

    def on_loaded(self, load_seconds: float, weight_bytes: int, kv_cache_bytes: int, kv_blocks: int,
                  cache_config: dict | None = None) -> None:
        """cache_config: vllm:cache_config_info's labels (block_size, cache_dtype, enable_prefix_caching)."""
        if cache_config is not None:
            self._l(self.cache_config, *(str(cache_config[k]) for k in ("block_size", "cache_dtype")), str(kv_blocks),
                    str(cache_config["enable_prefix_caching"])).set(1)
        self._l(self.load_seconds).set(load_seconds)
        self._l(self.weight_bytes).set(weight_bytes)
        self._l(self.kv_cache_bytes).set(kv_cache_bytes)
        self._l(self.kv_blocks_total).set(kv_blocks)
        self._l(self.healthy).set(1)

    def on_step(self, stats: EngineStats, stepped: bool) -> None:
        last = self._last
        for counter, now, before in (
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.prompt_tokens, stats.prompt_tokens_total, last.prompt_tokens_total),
                (self.generation_tokens, stats.generation_tokens_total, last.generation_tokens_total),
                (self.disk_queries, stats.kv_disk_queries, last.kv_disk_queries),
                (self.disk_hits, stats.kv_disk_hits, last.kv_disk_hits),
                (self.disk_read, stats.kv_disk_read_bytes, last.kv_disk_read_bytes),
                (self.disk_written, stats.kv_disk_written_bytes, last.kv_disk_written_bytes),
                (self.disk_corrupt, stats.kv_disk_corrupt_files, last.kv_disk_corrupt_files),
                (self.disk_dropped, stats.kv_disk_dropped_writes, last.kv_disk_dropped_writes),
                (self.spec_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
                (self.spec_draft_tokens, stats.spec_decode_num_draft_tokens, last.spec_decode_num_draft_tokens),
                (self.spec_accepted, stats.spec_decode_num_accepted_tokens, last.spec_decode_num_accepted_tokens)):
            if now > before:
                self._l(counter).inc(now - before)
        for pos, now in enumerate(stats.spec_decode_accepted_per_pos):
            before = last.spec_decode_accepted_per_pos[pos] if pos < len(last.spec_decode_accepted_per_pos) else 0
            if now > before:
                self._l(self.spec_accepted_per_pos, str(pos)).inc(now - before)
        self._last = stats
        self._l(self.running).set(stats.num_running)
        self._l(self.waiting).set(stats.num_waiting)
        self._l(self.kv_usage).set(stats.kv_cache_usage)
        self._l(self.kv_usage_legacy).set(stats.kv_cache_usage)
        self._l(self.kv_blocks, "used").set(stats.kv_blocks_used)
        self._l(self.kv_blocks, "cached").set(stats.kv_blocks_cached)
        self._l(self.kv_blocks, "free").set(stats.kv_blocks_free)
        self._l(self.disk_blocks).set(stats.kv_disk_blocks)
        self._l(self.disk_bytes).set(stats.kv_disk_bytes)
        self._l(self.disk_capacity).set(stats.kv_disk_capacity_bytes)
        if stepped:
            self._l(self.iteration_tokens).observe(stats.last_prefill_tokens + stats.last_decode_tokens)
            self._l(self.batch_size).observe(stats.last_batch_size)
        self._maybe_log(stats)

    def on_output(self, out: RequestOutput) -> None:
        now = time.time()
        rid = out.request_id
        if out.delta_token_ids:
            previous = self._last_token_time.get(rid)
            if previous is not None:
                gap = (now - previous) / len(out.delta_token_ids)
                for _ in out.delta_token_ids:
                    self._l(self.itl).observe(gap)
            self._last_token_time[rid] = now
        if not out.finished:
            return
        self._last_token_time.pop(rid, None)
        m = out.metrics
        reason = out.outputs[0].finish_reason or "error"
        self._l(self.success, reason if reason in FINISH_REASONS else "error").inc()
        self._l(self.request_prompt_tokens).observe(len(out.prompt_token_ids or ()))
        self._l(self.request_generation_tokens).observe(sum(len(c.token_ids) for c in out.outputs))
        if m is None:
            return
        finished = m.finished_time or now
        if m.num_draft_tokens:
            self._l(self.request_acceptance).observe(m.num_accepted_tokens / m.num_draft_tokens)
        if m.max_tokens is not None:
            self._l(self.request_max_tokens).observe(m.max_tokens)
        if m.first_token_time is not None:
            self._l(self.ttft).observe(m.time_to_first_token)
            decode = finished - m.first_token_time
            self._l(self.decode_time).observe(decode)
            generated = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
            if generated > 1:
                for metric in (self.tpot, self.tpot_legacy):
                    self._l(metric).observe(decode / (generated - 1))
        if m.first_scheduled_time is not None:
            self._l(self.queue_time).observe(m.first_scheduled_time - m.arrival_time)
            self._l(self.inference_time).observe(finished - m.first_scheduled_time)
            if m.first_token_time is not None:
                self._l(self.prefill_time).observe(m.first_token_time - m.first_scheduled_time)
        self._l(self.e2e).observe(finished - m.arrival_time)

    def set_healthy(self, healthy: bool) -> None:
        self._l(self.healthy).set(1 if healthy else 0)

    def exposition(self) -> bytes:
        self._l(self.rss).set(self._process.memory_info().rss)
        return generate_latest(self.registry)

    def _maybe_log(self, s: EngineStats) -> None:
        now = time.monotonic()
        if now - self._last_log < 5.0 or not (s.num_running or s.num_waiting):
            if not (s.num_running or s.num_waiting):
                self._window = (now, s.generation_tokens_total)
            return
        start, tokens = self._window
        rate = (s.generation_tokens_total - tokens) / max(now - start, 1e-9)
        log.info("running %d, waiting %d, KV %.1f%% (%d/%d blocks), prefix hit rate %.1f%%, %.1f gen tok/s",
                 s.num_running, s.num_waiting, 100 * s.kv_cache_usage, s.kv_blocks_used, s.kv_blocks_total,
                 100 * s.prefix_cache_hit_rate, rate)
        self._last_log = now
        self._window = (now, s.generation_tokens_total)


def merge_expositions(texts: list[bytes]) -> bytes:
    """Several engines' Prometheus texts as one scrape (an assistant's own model beside the main one,
    engine.fleet): each metric family once, with every engine's samples (told apart by model_name);
    series equal in name and labels (the process's own, which every registry reports) kept once."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    seen: set[str] = set()
    name = ""
    for text in texts:
        for line in text.decode().splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
            header, samples = families.setdefault(name, ([], []))
            if line.startswith("#"):
                if line not in header:
                    header.append(line)
            elif line and line.rsplit(" ", 1)[0] not in seen:
                seen.add(line.rsplit(" ", 1)[0])
                samples.append(line)
    return "".join("\n".join(header + samples) + "\n" for header, samples in families.values()).encode()
