"""Turning an engine stream into an HTTP answer: collect it whole (aborting when the client leaves),
or frame it as server-sent events in the endpoint's chunk shape."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.client import EngineDeadError, EngineOverloadedError
from engine.outputs import ChoiceCollector
from engine.tool_calls import ToolCallParser
from server.errors import APIError
from server.logprobs import CompletionLogprobs, chat_logprobs
from server.replies import chat_chunk, completion_chunk, error_body, usage


def finish_reason(out, error: str | None = None) -> str | None:
    """A choice's finish reason; a choice that failed in the engine is a 500 saying why (`error`)."""
    if out.finish_reason == "error":
        raise APIError(500, f"the request failed inside the engine: {error}" if error
                       else "the request failed inside the engine", "internal_error")
    return out.finish_reason


async def collect(stream: AsyncIterator, request: Request):
    """Run a request to the end, every choice of it (n > 1); if the client goes away first, cancel it
    (which aborts it)."""
    async def consume():
        choices = ChoiceCollector()
        async for out in stream:
            choices.add(out)
        return choices.whole()

    task = asyncio.ensure_future(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()  # the stream, cancelled where it waits, aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stream.aclose()  # (closed already, unless it had not started)
            raise APIError(499, "client disconnected", "client_closed_request")
    return task.result()


async def started(stream: AsyncIterator) -> AsyncIterator:
    """Wait for the first output before the response starts, so a refused request (bad input,
    overload) still gets its proper status code instead of a 200 with an error inside."""
    first = await stream.__anext__()

    async def chained():
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
    return chained()


def sse(events: AsyncIterator[dict], failure: Callable[[str], dict] | None = None,
        typed: bool = False) -> StreamingResponse:
    """Server-sent events: OpenAI's chat and completions framing (`data:` lines, then [DONE]), or with
    `typed` each event's type on an `event:` line and no [DONE] (the Responses and Messages APIs).
    failure(message): the event that ends a stream the engine failed mid-way."""
    failure = failure or (lambda message: error_body(message, "service_unavailable"))

    def frame(event: dict) -> str:
        return (f"event: {event['type']}\n" if typed else "") + f"data: {json.dumps(event)}\n\n"

    async def body():
        try:
            async for event in events:
                yield frame(event)
        except (EngineDeadError, EngineOverloadedError, ValueError) as e:
            yield frame(failure(str(e)))
        if not typed:
            yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def _events(stream, make_chunks: Callable, obj: str, rid: str, model: str, created: int, prompt_len: int,
            include_usage: bool, with_ids: bool, on_finish: Callable, logprobs_of: Callable | None):
    """SSE payloads of one request: each choice's deltas and its finishing chunk (n > 1 interleaves
    them, told apart by index), then usage if asked for. make_chunks(index, text, token_ids or None,
    finish_reason, logprobs or None) builds the endpoint's chunks for one delta; logprobs_of(index,
    token_ids, entries) the logprobs of a delta's tokens (None: not asked)."""
    async def gen():
        choices = ChoiceCollector()
        async for out in stream:
            choices.add(out)
            choice, new = out.outputs[0], out.delta_token_ids
            if out.delta_text or (new and (with_ids or logprobs_of)):
                scores = logprobs_of(choice.index, new, choice.logprobs[-len(new):]) if logprobs_of and new else None
                for chunk in make_chunks(choice.index, out.delta_text, new if with_ids else None, None, scores):
                    yield chunk
            if choice.finish_reason == "error":
                yield error_body(out.error or "the request failed inside the engine", "internal_error")
                return
            if choice.finish_reason is not None:
                for chunk in make_chunks(choice.index, "", None, choice.finish_reason, None):
                    yield chunk
            if out.finished:
                final = choices.whole()
                on_finish(final)
                if include_usage:
                    yield {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                           "usage": usage(prompt_len, sum(len(c.token_ids) for c in final.outputs),
                                          final.num_cached_tokens)}
    return gen()


async def chat_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish,
                      top_logprobs: int | None = None, n: int = 1, tools: bool = False):
    """tools: the reply may hold tool calls, streamed as OpenAI does (delta.tool_calls: the head with
    index, id and name, then argument fragments); their text never reaches delta.content."""
    parsers = {index: ToolCallParser() for index in range(n)} if tools else None

    def make_chunks(index, text, token_ids, reason, scores):
        if parsers is None:
            deltas = [{} if reason else {"content": text}]
        else:
            parser = parsers[index]
            deltas = parser.finish() if reason else parser.feed(text)
            if reason == "stop" and parser.calls:
                reason = "tool_calls"
            if reason:
                deltas.append({})
            elif not deltas:
                deltas.append({"content": ""})
        chunks = [chat_chunk(rid, model, created, delta, None, None, index) for delta in deltas]
        last = chunks[-1]["choices"][0]
        last["finish_reason"], last["logprobs"] = reason, scores
        if token_ids is not None:
            last["token_ids"] = token_ids
        return chunks

    logprobs_of = None if top_logprobs is None else (lambda _, ids, entries: chat_logprobs(ids, entries, top_logprobs))
    for index in range(n):
        yield chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=index)
    async for event in _events(stream, make_chunks, "chat.completion.chunk", rid, model, created, prompt_len,
                               include_usage, with_ids, on_finish, logprobs_of):
        yield event


async def completion_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish,
                            scorer: Callable[[], CompletionLogprobs] | None = None,
                            echo: tuple[str, list[int]] | None = None, n: int = 1):
    """scorer() makes one choice's logprobs formatter (its text offsets run on across its chunks);
    echo: (prompt text, prompt ids), sent first for each of the n choices, scored when asked for."""
    def make_chunk(index, text, token_ids, reason, scores):
        return completion_chunk(rid, model, created, text, index, reason, token_ids, scores)

    per_choice: dict[int, CompletionLogprobs] = {}

    def logprobs(index, ids, entries):
        return per_choice.setdefault(index, scorer())(ids, entries)

    first = await stream.__anext__()
    if echo is not None:
        for index in range(n):
            scores = logprobs(index, echo[1], first.prompt_logprobs) if scorer and first.prompt_logprobs else None
            yield make_chunk(index, echo[0], echo[1] if with_ids else None, None, scores)

    async def rest():
        yield first
        async for out in stream:
            yield out
    async for event in _events(rest(), lambda *a: [make_chunk(*a)], "text_completion", rid, model, created,
                               prompt_len, include_usage, with_ids, on_finish, logprobs if scorer else None):
        yield event
