"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat route's
rendering, sampling and engine (server/anthropic_items.py), whole or streamed as Anthropic streams it
(message_start, content_block_start / _delta / _stop for text and tool_use blocks, message_delta,
message_stop). Keys come as `x-api-key` (Anthropic's header) or `Authorization: Bearer`; errors
come in Anthropic's shape (server/errors.py)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from engine.client import ModelInfo
from engine.tool_calls import ToolCallParser
from server.anthropic_items import (CountTokensRequest, MessagesRequest, message_id, reply_blocks, stop_of,
                                   usage)
from server.deps import check_key, finish_logger, generation, prepare_chat, render_chat, serving
from server.streaming import collect, finish_reason, sse, started

router = APIRouter(dependencies=[Depends(check_key)])


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    chat = body.chat_request()
    client, info, name, ids, params = await prepare_chat(request, chat)
    tools = chat.tool_plan is not None and chat.tool_plan.grammar is not None
    mid = message_id()
    on_finish = finish_logger(request, len(ids), chat.messages)
    stream = generation(request, client, ids, params, mid, chat)
    if body.stream:
        return sse(message_events(await started(stream), mid, name, info, tools, on_finish), stream_failure,
                   typed=True)
    final = await collect(stream, request)
    on_finish(final)
    out = final.outputs[0]
    finish_reason(out, final.error)  # an engine failure is a 500 saying why
    content = reply_blocks(out.text, tools)
    stop, sequence = stop_of(out, any(b["type"] == "tool_use" for b in content))
    return message(mid, name, content, stop, sequence, info, final)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    chat = body.chat_request()
    _, info, _ = serving(request, chat.model)
    return {"input_tokens": len(await asyncio.to_thread(render_chat, info, chat))}


def message(mid: str, model: str, content: list, stop: str | None, sequence: str | None, info: ModelInfo,
            final) -> dict:
    prompt, cached = len(final.prompt_token_ids), final.num_cached_tokens
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": sequence,
            "usage": usage(prompt, len(final.outputs[0].token_ids), cached, info.cache_writes(prompt, cached))}


async def message_events(stream, mid: str, model: str, info: ModelInfo, tools: bool, on_finish):
    """A streamed message's events; a tool call's head opens a tool_use block whose input streams as
    input_json_delta pieces (text the call format wraps never reaches a text block)."""
    parser, index, open_kind, has_calls = (ToolCallParser() if tools else None), -1, None, False
    first = True
    async for out in stream:
        if first:  # the prompt's cache use is known from the first output on
            first = False
            start = message(mid, model, [], None, None, info, out)
            start["usage"]["output_tokens"] = 0
            yield {"type": "message_start", "message": start}
        choice = out.outputs[0]
        deltas = parser.feed(out.delta_text) if parser else ([{"content": out.delta_text}] if out.delta_text else [])
        if out.finished and parser:
            deltas += parser.finish()
        for delta in deltas:
            if "content" in delta:
                if open_kind != "text":
                    if open_kind is not None:
                        yield {"type": "content_block_stop", "index": index}
                    index, open_kind = index + 1, "text"
                    yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": delta["content"]}}
                continue
            part = delta["tool_calls"][0]
            if "id" in part:
                if open_kind is not None:
                    yield {"type": "content_block_stop", "index": index}
                index, open_kind, has_calls = index + 1, "tool_use", True
                yield {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": part["id"], "name": part["function"]["name"], "input": {}}}
            else:
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": part["function"]["arguments"]}}
        if choice.finish_reason == "error":
            yield {"type": "error", "error": {"type": "api_error",
                                              "message": out.error or "the request failed inside the engine"}}
            return
        if not out.finished:
            continue
        if open_kind is None:  # a reply with neither text nor calls still has its (empty) text block
            index = 0
            yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        yield {"type": "content_block_stop", "index": index}
        on_finish(out)
        stop, sequence = stop_of(choice, has_calls)
        yield {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": sequence},
               "usage": message(mid, model, [], None, None, info, out)["usage"]}
        yield {"type": "message_stop"}


def stream_failure(message: str) -> dict:
    return {"type": "error", "error": {"type": "overloaded_error", "message": message}}
