"""Turning an engine stream into an HTTP answer: collect it whole (aborting when the client leaves),
or frame it as server-sent events in the endpoint's chunk shape."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.client import EngineDeadError, EngineOverloadedError
from server.errors import APIError
from server.protocol import chat_chunk, completion_chunk, error_body, usage


def finish_reason(out) -> str | None:
    if out.finish_reason == "error":
        raise APIError(500, "the request failed inside the engine", "internal_error")
    return out.finish_reason


async def collect(stream: AsyncIterator, request: Request):
    """Run a request to the end; if the client goes away first, cancel it (which aborts it)."""
    async def consume():
        last = None
        async for last in stream:
            pass
        return last

    task = asyncio.ensure_future(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            await stream.aclose()
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


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except (EngineDeadError, EngineOverloadedError, ValueError) as e:
            yield f"data: {json.dumps(error_body(str(e), 'service_unavailable'))}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def _events(stream, make_chunk: Callable, obj: str, rid: str, model: str, created: int, prompt_len: int,
            include_usage: bool, with_ids: bool, on_finish: Callable):
    """SSE payloads of one request: deltas, the finishing chunk, then usage if asked for.
    make_chunk(text, token_ids or None, finish_reason) builds the endpoint's chunk shape."""
    async def gen():
        async for out in stream:
            if out.delta_text or (with_ids and out.delta_token_ids):
                yield make_chunk(out.delta_text, out.delta_token_ids if with_ids else None, None)
            if not out.finished:
                continue
            on_finish(out)
            final = out.outputs[0]
            if final.finish_reason == "error":
                yield error_body(out.error or "the request failed inside the engine", "internal_error")
                return
            yield make_chunk("", None, final.finish_reason)
            if include_usage:
                yield {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                       "usage": usage(prompt_len, len(final.token_ids), out.num_cached_tokens)}
    return gen()


async def chat_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish):
    def make_chunk(text, token_ids, reason):
        chunk = chat_chunk(rid, model, created, {} if reason else {"content": text}, reason)
        if token_ids is not None:
            chunk["choices"][0]["token_ids"] = token_ids
        return chunk

    yield chat_chunk(rid, model, created, {"role": "assistant", "content": ""})
    async for event in _events(stream, make_chunk, "chat.completion.chunk", rid, model, created, prompt_len,
                               include_usage, with_ids, on_finish):
        yield event


def completion_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish):
    def make_chunk(text, token_ids, reason):
        return completion_chunk(rid, model, created, text, finish_reason=reason, token_ids=token_ids)

    return _events(stream, make_chunk, "text_completion", rid, model, created, prompt_len, include_usage,
                   with_ids, on_finish)
