"""A fake EngineClient for the fast tier: the server's routes and the UI's handlers run against it
without a model. It replies with scripted tokens, records what it was asked, and can refuse."""
from __future__ import annotations

import asyncio
import threading
import time

from engine.client import ContextLengthError, EngineDeadError, ModelInfo
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


class FakeEngineClient:
    def __init__(self, tokenizer, *, max_model_len: int = 512, reply: str = " Your parcel ships today.",
                 name: str = "fake-model") -> None:
        self.state, self.error = "ready", None
        self.info = ModelInfo(name, None, tokenizer, max_model_len, len(tokenizer), "cpu", "float32", "none")
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.resets = 0
        self.requests: list[dict] = []  # every admitted request: prompt, params, request_id, session_id
        self.aborted: list[str] = []
        self.refuse_with: Exception | None = None  # raised at admission when set
        self.gate: asyncio.Event | None = None  # when set, each token waits for it (a slow engine)
        self.die_after: int | None = None  # when set, the engine goes away after this many tokens
        self.switches: list[tuple] = []
        self.next_replies: list[str] = []  # when set, each request takes the first as its reply instead
        self.loaded = threading.Event()  # set when the model is ready (start_loading clears it)
        self.loaded.set()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        self.loaded.wait(timeout)
        return self.ready

    def start_loading(self) -> None:
        """As at a fresh start: no model yet, until finish_loading()."""
        self.state, self.loaded = "loading", threading.Event()

    def finish_loading(self) -> None:
        self.state = "ready"
        self.loaded.set()

    async def generate(self, prompt, params: SamplingParams, *, request_id=None, priority=0, session_id=None,
                       cache_salt=None):
        ids = list(prompt) if not isinstance(prompt, str) else self.info.tokenizer.encode(prompt)
        if self.refuse_with is not None:
            raise self.refuse_with
        if len(ids) >= self.info.max_model_len:
            raise ContextLengthError(f"prompt is {len(ids)} tokens but max_model_len is {self.info.max_model_len}",
                                     "prompt")
        request_id = request_id or f"fake-{len(self.requests)}"
        self.requests.append({"prompt": ids, "params": params, "request_id": request_id, "session_id": session_id,
                              "cache_salt": cache_salt})
        reply = (self.info.tokenizer.encode(self.next_replies.pop(0), add_special_tokens=False) if self.next_replies
                 else self.reply_ids)
        tokens = reply[:params.max_tokens] if params.max_tokens else reply
        arrival, done = time.time(), False
        try:
            for n in range(1, len(tokens) + 1):
                if self.gate is not None:
                    await self.gate.wait()
                if self.die_after is not None and n > self.die_after:
                    raise EngineDeadError("the engine answering this chat went away mid-reply")
                await asyncio.sleep(0)
                finished = n == len(tokens)
                reason = None if not finished else ("length" if n == params.max_tokens else "stop")
                text = self.info.tokenizer.decode(tokens[:n])
                previous = self.info.tokenizer.decode(tokens[:n - 1])
                metrics = RequestMetrics(arrival, arrival, arrival + 0.01, time.time() if finished else None)
                scores = [self._scores(t, params.logprobs) for t in tokens[:n]] if params.logprobs is not None else None
                prompt_scores = ([None] + [self._scores(t, params.prompt_logprobs) for t in ids[1:]]
                                 if params.prompt_logprobs is not None else None)
                yield RequestOutput(request_id, None, ids, [CompletionOutput(0, text, tokens[:n], reason, None, scores)],
                                    finished, num_cached_tokens=0, metrics=metrics, delta_text=text[len(previous):],
                                    delta_token_ids=[tokens[n - 1]], prompt_logprobs=prompt_scores)
            done = True
        finally:
            if not done:
                self.aborted.append(request_id)

    def _scores(self, token: int, top: int) -> dict:
        """Scripted log-probabilities: the token itself ranked first at -0.25, then `top` others."""
        decode = self.info.tokenizer.decode
        entry = {token: Logprob(-0.25, 1, decode([token]))}
        for rank, other in enumerate((t for t in range(100, 200) if t != token), 2):
            if rank > top:
                break
            entry[other] = Logprob(-1.0 * rank, rank, decode([other]))
        return entry

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def snapshot(self) -> dict | None:
        return None

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def metrics_text(self) -> bytes:
        return b"# fake\n"

    def quantization_choices(self, model):
        return ["none", "int8"]

    def switch_model(self, model, quantization) -> str:
        self.switches.append((model, quantization))
        if model == "broken":
            raise ValueError("could not load broken: not a model")
        return f"loaded {model}"

    def shutdown(self) -> None:
        self.state = "dead"


async def press_stop(turn) -> None:
    """What Stop does to a turn waiting on the engine (fake.gate cleared): its event's task is cancelled,
    then the turn closed."""
    import contextlib

    pending = asyncio.ensure_future(turn.__anext__())
    await asyncio.sleep(0.01)
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    await turn.aclose()


def serving_replies(tokenizer, *replies: str):
    """(a fake engine that answers `replies` in turn, a TestClient of the API routes over it)."""
    from fastapi.testclient import TestClient

    from server.routes import create_app

    fake = FakeEngineClient(tokenizer, max_model_len=2048)
    fake.next_replies = list(replies)
    return fake, TestClient(create_app(fake))
