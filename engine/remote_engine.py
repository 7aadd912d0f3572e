"""The engine front for a UI tier whose engines run elsewhere (scale-out): the same calls the UI
makes on AsyncLLM, carried over the OpenAI API of pagedchat engine pods.

The tokenizer and chat template load locally from the same model (no weights), so prompts stay
token-exact; prompts go out as token ids and replies come back with theirs (`return_token_ids`).
Closing a stream closes the HTTP response, which the engine pod turns into an abort.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx

from engine.async_engine import EngineDeadError
from engine.config import EngineConfig
from engine.loader import load_config_and_tokenizer, resolve_model
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


class RemoteLLM:
    def __init__(self, url: str, config: EngineConfig, api_key: str | None = None) -> None:
        self.remote_url = url.rstrip("/")
        self.base = self.remote_url.removesuffix("/v1")
        self.config = config
        self.metrics = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        _, tokenizer = load_config_and_tokenizer(resolve_model(config.model))
        self.engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=config.max_model_len or 8192)
        self._model: str | None = None
        self._ready_at = 0.0
        self._open: dict[str, tuple[asyncio.AbstractEventLoop, httpx.Response]] = {}

    # ---- what AsyncLLM offers ---------------------------------------------------------------
    @property
    def ready(self) -> bool:
        if time.monotonic() - self._ready_at < 2.0:
            return True
        try:
            ok = httpx.get(f"{self.base}/health", timeout=3).status_code == 200
            if ok and self._model is None:
                info = httpx.get(f"{self.remote_url}/models", headers=self._headers, timeout=5).json()["data"][0]
                self._model, self.engine.max_model_len = info["id"], info.get("max_model_len", 8192)
        except (httpx.HTTPError, KeyError, ValueError, IndexError):
            return False
        if ok:
            self._ready_at = time.monotonic()
        return ok

    @property
    def state(self) -> str:
        return "ready" if self.ready else "dead"

    @property
    def error(self) -> str | None:
        return None if self.ready else f"engine at {self.remote_url} is not answering"

    def wait_ready(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (timeout or 0)
        while not self.ready and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.ready

    @property
    def model_name(self) -> str:
        return self._model or self.config.model or "remote"

    async def generate(self, prompt: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise EngineDeadError(self.error)
        request_id = request_id or f"remote-{time.time_ns()}"
        body = {"model": self.model_name, "prompt": list(prompt), "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "priority": priority, **_sampling_fields(params)}
        headers = {**self._headers, "X-Request-Id": request_id, "X-Session-Id": request_id.split(":")[1]
                   if request_id.count(":") >= 2 else request_id}
        metrics = RequestMetrics(time.time(), None, None, None)
        text, ids, reason, cached = "", [], None, 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
            async with client.stream("POST", f"{self.remote_url}/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    error = json.loads(await r.aread()).get("error", {})
                    raise (EngineDeadError if r.status_code == 503 else ValueError)(error.get("message", r.text))
                self._open[request_id] = (asyncio.get_running_loop(), r)
                try:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise EngineDeadError(chunk["error"].get("message"))
                        if chunk.get("usage"):
                            cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                        for choice in chunk.get("choices", []):
                            delta, delta_ids = choice.get("text", ""), choice.get("token_ids") or []
                            if delta_ids and metrics.first_token_time is None:
                                metrics.first_token_time = metrics.first_scheduled_time = time.time()
                            text, ids = text + delta, ids + delta_ids
                            reason = choice.get("finish_reason") or reason
                            if delta or delta_ids:
                                yield _output(request_id, prompt, text, ids, None, cached, metrics, delta, delta_ids)
                finally:
                    self._open.pop(request_id, None)
        metrics.finished_time = time.time()
        yield _output(request_id, prompt, text, ids, reason or "stop", cached, metrics, "", [])

    def abort(self, request_id: str) -> None:
        entry = self._open.get(request_id)
        if entry is not None:
            loop, response = entry
            asyncio.run_coroutine_threadsafe(response.aclose(), loop)

    def call(self, fn, timeout: float = 60):
        raise EngineDeadError(f"the engine runs at {self.remote_url}; there is no local engine to inspect")

    def switch_model(self, config: EngineConfig) -> str:
        raise ValueError(f"the engines run at {self.remote_url}: change the model of those pods")

    def shutdown(self) -> None:
        pass


def _sampling_fields(p: SamplingParams) -> dict:
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
            "min_p": p.min_p, "stop": p.stop_strings or None, "seed": p.seed, "min_tokens": p.min_tokens,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "ignore_eos": p.ignore_eos,
            "stop_token_ids": p.stop_token_ids or None}


def _output(rid, prompt, text, ids, reason, cached, metrics, delta, delta_ids) -> RequestOutput:
    return RequestOutput(rid, None, list(prompt), [CompletionOutput(0, text, list(ids), reason)],
                         finished=reason is not None, num_cached_tokens=cached,
                         metrics=RequestMetrics(**vars(metrics)), delta_text=delta, delta_token_ids=list(delta_ids))
