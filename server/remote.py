"""RemoteLLM: the EngineClient of a UI tier whose engines run elsewhere (scale-out), carried over
the OpenAI API of pagedchat engine pods.

The tokenizer and chat template load locally from the same model (no weights, no torch), so
prompts stay token-exact; prompts go out as token ids and replies come back with theirs
(`return_token_ids`). Health is polled by a background thread, so no call made from async code
blocks on the network. Closing a stream closes the HTTP response, which the pod turns into an abort.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx

from engine.checkpoint.source import load_config_and_tokenizer, resolve_model, sampling_defaults
from engine.client import EngineDeadError, EngineOverloadedError, ModelInfo
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from server.limits import TooManyRequestsError
from server.protocol import SamplingFields


# SamplingParams fields that completion_fields does not send, and why (a test holds every other
# field to reaching the engine pod).
NOT_FORWARDED = {"n": "RemoteLLM refuses n > 1", "logprobs": "RemoteLLM refuses logprobs",
                 "prompt_logprobs": "RemoteLLM refuses logprobs"}


def completion_fields(p: SamplingParams) -> dict:
    """The /v1/completions fields that make an engine pod sample as `p` does: every SamplingFields
    field SamplingParams shares, except NOT_FORWARDED, in the API's spelling."""
    shared = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - set(NOT_FORWARDED)
    body = {name: getattr(p, name) for name in SamplingFields.model_fields if name in shared}
    body["stop"] = p.stop_strings or None
    body["stop_token_ids"] = p.stop_token_ids or None
    body["logit_bias"] = {str(t): b for t, b in (p.logit_bias or {}).items()} or None
    body["structured_outputs"] = ({k: v for k, v in vars(p.structured_outputs).items() if v is not None}
                                  if p.structured_outputs else None)
    return body


class RemoteLLM:
    def __init__(self, url: str, model: str | None, api_key: str | None = None, poll_seconds: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.state, self.error = "loading", None
        self._base = self.url.removesuffix("/v1")
        self._model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._info: ModelInfo | None = None
        self._open: dict[str, tuple[asyncio.AbstractEventLoop, httpx.Response]] = {}
        self._poll_seconds = poll_seconds
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="remote-health", daemon=True)
        self._thread.start()

    # ---- state, polled off every caller's path ----------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def info(self) -> ModelInfo | None:
        return self._info

    def wait_ready(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (timeout or 0)
        with self._changed:
            while not self.ready and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
        return self.ready

    def _poll(self) -> None:
        try:
            source = resolve_model(self._model)
            config, tokenizer = load_config_and_tokenizer(source)
            defaults, where = sampling_defaults(source)
        except Exception as e:  # noqa: BLE001 - nothing can be rendered without the tokenizer
            self._set("dead", f"could not load the tokenizer of {self._model or 'the default model'}: {e}")
            return
        with httpx.Client(timeout=5, headers=self._headers) as http:
            while not self._stop.is_set():
                try:
                    ok = http.get(f"{self._base}/health").status_code == 200
                    if ok and self._info is None:
                        served = http.get(f"{self.url}/models").json()["data"][0]
                        self._info = ModelInfo(served["id"], self._model, tokenizer,
                                               served.get("max_model_len", 8192), config.vocab_size,
                                               f"remote ({self.url})", "remote", "remote", defaults, where)
                except (httpx.HTTPError, KeyError, ValueError, IndexError):
                    ok = False
                self._set("ready" if ok else "dead", None if ok else f"the engine at {self.url} is not answering")
                self._stop.wait(self._poll_seconds)

    def _set(self, state: str, error: str | None) -> None:
        with self._changed:
            self.state, self.error = state, error
            self._changed.notify_all()

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, session_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.ready or self._info is None:
            raise EngineDeadError(self.error or "the engine is not answering yet")
        if params.n > 1 or params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("n > 1 and logprobs are served by the engine pods' own API, not through the UI tier")
        request_id = request_id or f"remote-{time.time_ns()}"
        body = {"model": self._info.name, "prompt": list(prompt), "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "priority": priority, **completion_fields(params)}
        if cache_salt:
            body["cache_salt"] = cache_salt
        headers = {**self._headers, "X-Request-Id": request_id, "X-Session-Id": session_id or request_id}
        metrics = RequestMetrics(time.time(), None, None, None, params.max_tokens)
        text, ids, reason, cached = "", [], None, 0
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
                async with client.stream("POST", f"{self.url}/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        raise _refusal(r.status_code, await r.aread())
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
                                    yield _output(request_id, prompt, text, ids, None, cached, metrics, delta,
                                                  delta_ids)
                    finally:
                        self._open.pop(request_id, None)
        except httpx.HTTPError as e:  # the engine pod went away (killed, restarted, unreachable)
            raise EngineDeadError(f"the engine answering this chat went away ({type(e).__name__}); "
                                  f"send again to continue on another one") from None
        if reason is None:
            raise EngineDeadError("the engine answering this chat went away mid-reply; send again to continue")
        metrics.finished_time = time.time()
        yield _output(request_id, prompt, text, ids, reason or "stop", cached, metrics, "", [])

    def abort(self, request_id: str) -> None:
        entry = self._open.get(request_id)
        if entry is not None:
            loop, response = entry
            asyncio.run_coroutine_threadsafe(response.aclose(), loop)

    def reset_prefix_cache(self) -> None:
        """Resets the engine this call reaches (behind a load balancer: one pod of several)."""
        r = httpx.post(f"{self._base}/reset_prefix_cache", headers=self._headers, timeout=30)
        if r.status_code != 200:
            raise _refusal(r.status_code, r.content)

    # ---- what only an in-process engine has ---------------------------------------------------
    def snapshot(self) -> dict | None:
        return None

    def metrics_text(self) -> bytes:
        return b""

    def quantization_choices(self, model: str | None) -> list[str]:
        return []

    def switch_model(self, model: str | None, quantization: str | None) -> str:
        raise ValueError(f"the engines run at {self.url}: change the model of those pods")

    def shutdown(self) -> None:
        self._stop.set()


def _refusal(status: int, body: bytes) -> Exception:
    try:
        message = json.loads(body).get("error", {}).get("message") or body.decode(errors="replace")
    except ValueError:
        message = body.decode(errors="replace")
    if status == 429:
        return TooManyRequestsError(message)
    if status in (502, 504):  # the proxy in front of the engine pods found none answering
        return EngineDeadError(f"no engine is answering ({status}): {message[:200]}")
    if status == 503:
        return EngineOverloadedError(message) if "overloaded" in message else EngineDeadError(message)
    return ValueError(message)


def _output(rid, prompt, text, ids, reason, cached, metrics, delta, delta_ids) -> RequestOutput:
    return RequestOutput(rid, None, list(prompt), [CompletionOutput(0, text, list(ids), reason)],
                         finished=reason is not None, num_cached_tokens=cached,
                         metrics=RequestMetrics(**vars(metrics)), delta_text=delta, delta_token_ids=list(delta_ids))
