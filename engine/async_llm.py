"""AsyncLLM, the in-process EngineClient: one engine thread drives step(); callers on any thread
or event loop submit requests and read their deltas from an async iterator.

Locking rule: only the engine thread touches the LLMEngine. Other threads talk to it through
`_inbox` (engine/inbox.py) and get answers through futures and per-request queues; what
they may read directly is `info` (immutable) and the Prometheus metrics (thread-safe).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import psutil

from engine.client import EngineDeadError, ModelInfo
from engine.config import EngineConfig
from engine.cpu_turns import cpu_turn
from engine.inbox import Inbox
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.snapshot import take_snapshot
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("pagedchat.async")
# One model loads at a time in this process: two engines loading at once (engine.fleet) raced in
# transformers' lazy imports ("cannot import name 'AutoConfig'"), and would only share the cores.
_LOADING = threading.Lock()


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """The engine in this process, behind the EngineClient interface (engine/client.py)."""

    def __init__(self, config: EngineConfig, *, load: bool = True) -> None:
        self.config = config
        self._engine: LLMEngine | None = None
        self._info: ModelInfo | None = None
        self.metrics: EngineMetrics | None = None
        self.state = "loading"  # loading | ready | draining | dead
        self.error: str | None = None
        self._inbox = Inbox()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = False
        self._loaded = threading.Event()
        self._switching = threading.Lock()
        self._draining: LLMEngine | None = None  # the previous model, finishing its replies after a switch
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)
        if load:
            self._thread.start()

    # ---- lifecycle ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._loaded.wait(timeout)
        return self.ready

    def shutdown(self) -> None:
        self._stop = True
        self._inbox.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        for engine in (self._engine, self._draining):
            if engine is not None:
                engine.close()

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    # ---- requests (any thread / event loop) -----------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, session_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step with new text; the last has finished=True. If the caller
        stops iterating (client gone, task cancelled), the request is aborted at once."""
        if not self.ready:
            raise EngineDeadError(self.error or "the engine is still loading")
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: concurrent.futures.Future = concurrent.futures.Future()

        def add() -> None:
            try:
                self._engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                         session_id=session_id, cache_salt=cache_salt)
                self._streams[request_id] = stream
                added.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the caller as is
                added.set_exception(e)

        self._submit(add, added)
        await asyncio.wrap_future(added)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            for engine in (self._engine, self._draining):
                if engine is not None:
                    engine.abort_request(request_id)
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
            self._submit(do)

    def drain(self, grace_s: float) -> None:
        """Shutting down: from now on new requests are refused (EngineDeadError, "the server is
        shutting down"; /health 503, so a load balancer sends no more); those in flight may finish
        for `grace_s` seconds, then are aborted, so every stream ends with a finish reason."""
        self.state, self.error = "draining", "the server is shutting down"
        timer = threading.Timer(grace_s, lambda: [self.abort(rid) for rid in list(self._streams)])
        timer.daemon = True
        timer.start()

    def snapshot(self) -> dict | None:
        if not self.ready:
            return None
        return self.run_on_engine_thread(take_snapshot, timeout=30)

    def reset_prefix_cache(self) -> None:
        if not self.ready:
            raise EngineDeadError(self.error or "the engine is still loading")
        self.run_on_engine_thread(lambda engine: engine.reset_prefix_cache())

    def metrics_text(self) -> bytes:
        return self.metrics.exposition() if self.metrics is not None else b""

    def run_on_engine_thread(self, fn: Callable[[LLMEngine], object], timeout: float = 60) -> object:
        """fn(engine) on the engine thread, its result returned. For tests and tools that inspect
        the engine; the product goes through the EngineClient methods."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def do() -> None:
            try:
                fut.set_result(fn(self._engine))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)
        self._submit(do, fut)
        return fut.result(timeout)

    # ---- models ---------------------------------------------------------------------------
    def quantization_choices(self, model: str | None) -> list[str]:
        from engine.quant.choices import quantization_choices_for

        return quantization_choices_for(model, self.config)

    def switch_model(self, model: str | None, quantization: str | None) -> str:
        """Load another model without stalling anyone: it loads on the caller's thread while the old
        one keeps serving; the swap happens between steps; replies in flight finish on the old model
        (it keeps stepping until they are done, then is dropped) while new requests go to the new one.
        A failed load leaves the old model serving and raises ValueError. Blocks the caller until
        loaded; returns a line saying what happened, with the memory both models took at once."""
        from engine.quant.choices import resolve_switch

        if not self._switching.acquire(blocking=False):
            raise ValueError("a model switch is already in progress")
        try:
            model, quantization = resolve_switch(model, quantization)  # may run our GPTQ producer first
            config = dataclasses.replace(self.config, model=model, quantization=quantization)
            rss_before, t0 = psutil.Process().memory_info().rss, time.perf_counter()
            try:
                with _LOADING:
                    new = LLMEngine(config)
            except Exception as e:
                self.metrics.load_failures.labels(self.metrics.model_name).inc()
                raise ValueError(f"could not load {config.model or 'the default model'}: {e}") from e
            both = psutil.Process().memory_info().rss

            def swap(old: LLMEngine) -> int:
                self._engine, self.config, self._draining = new, config, old
                self._loaded_new(new)
                return len(old._tracked)
            finishing = self.run_on_engine_thread(swap, timeout=600)
            in_flight = {0: "no reply was in flight", 1: "1 reply in flight finishes on the old model"}.get(
                finishing, f"{finishing} replies in flight finish on the old model")
            return (f"loaded {new.source.name} in {time.perf_counter() - t0:.1f}s while the old model served; "
                    f"{in_flight}; memory {rss_before / 2**20:.0f} MiB before, {both / 2**20:.0f} MiB with both "
                    f"models loaded")
        finally:
            self._switching.release()

    def _loaded_new(self, engine: LLMEngine) -> None:
        self._info = engine.model_info(self.config.model)
        self.metrics = EngineMetrics(engine.source.name)
        c = engine.config
        self.metrics.on_loaded(engine.load_seconds, engine.weight_bytes, engine.runner.kv_cache_bytes,
                               engine.kv.pool.num_blocks, {"block_size": c.block_size, "cache_dtype": c.kv_cache_dtype,
                                                           "enable_prefix_caching": c.enable_prefix_caching})
        self.metrics.on_step(engine.get_stats(), stepped=False)

    def _deliver(self, out: RequestOutput) -> None:
        self.metrics.on_output(out)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if not self._put(stream, out):  # nobody can read it any more: free its blocks now
            self._streams.pop(out.request_id, None)
            self.abort(out.request_id)

    @staticmethod
    def _put(stream: _Stream, item: RequestOutput | BaseException) -> bool:
        """Hands `item` to the stream's event loop; False when that loop has closed (its server
        stopped while the request ran), which must not take the engine thread down with it."""
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:
            return False

    def _submit(self, command: Callable[[], None], answer: concurrent.futures.Future | None = None) -> None:
        """Queues `command` for the engine thread; `answer` is the future its caller waits on."""
        self._inbox.put(command, answer)

    def _end(self, error: str) -> None:
        """The engine thread is ending: the engine is dead, and every caller still waiting (a queued
        command's future, an open stream) gets EngineDeadError instead of waiting for ever."""
        self.state, self.error = "dead", error
        self._inbox.close(error)
        for stream in list(self._streams.values()):
            self._put(stream, EngineDeadError(error))
        self._streams.clear()

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with _LOADING:
                self._engine = LLMEngine(self.config)
            self._loaded_new(self._engine)
            self.state = "ready"
        except Exception as e:  # noqa: BLE001
            log.exception("model load failed")
            self._end(f"model load failed: {e}")
            self._loaded.set()
            return
        self._loaded.set()
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - a crashed loop fails everyone, loudly
            log.exception("engine loop crashed")
            self.metrics.set_healthy(False)
            self._end(f"engine loop crashed: {type(e).__name__}: {e}")
        else:
            self._end(self.error or "the engine was shut down")

    def _loop(self) -> None:
        while not self._stop:
            while command := self._inbox.take():
                command()
            engine = self._engine  # a command may have switched the model
            outputs = []
            if engine.has_unfinished_requests() or self._draining is not None:
                with cpu_turn():  # other models in this process step in turn, never at once
                    outputs = engine.step() if engine.has_unfinished_requests() else []
                    if self._draining is not None:  # after a switch: the old model finishes its replies
                        outputs += self._draining.step()
            if self._draining is not None and not self._draining.has_unfinished_requests():
                self._draining.close()
                self._draining = None
            busy = engine.has_unfinished_requests() or self._draining is not None
            for out in outputs:
                self._deliver(out)
            self.metrics.on_step(engine.get_stats(), stepped=bool(outputs) or busy)
            if not busy:
                self._inbox.wake.wait(timeout=1.0)

