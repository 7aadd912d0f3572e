"""A response as it is made: the output items of a finished reply, or the Responses API's event stream
(response.created, output_item.added, output_text.delta, function_call_arguments.delta, ...,
response.completed), both read from the reply the same way (engine/tool_calls.py's parser)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from engine.client import ModelInfo
from engine.tool_calls import ToolCall, ToolCallParser, read_reply
from server.logprobs import chat_logprobs
from server.responses_items import call_item, item_id, message_item, status_of, usage


def finished_response(base: dict, final, info: ModelInfo, tools: bool, top_logprobs: int | None) -> dict:
    """The response object of a finished request (`base`: its id, model and settings)."""
    out = final.outputs[0]
    scores = chat_logprobs(out.token_ids, out.logprobs, top_logprobs)["content"] if top_logprobs is not None else None
    content, calls, cut = out.text, [], None
    if tools:
        reply = read_reply(out.text)
        content, calls, cut = reply.content.strip(), reply.calls, reply.cut
    output = [message_item(content, scores)] if content or not (calls or cut) else []
    output += [call_item(c) for c in calls] + ([call_item(cut, "incomplete")] if cut else [])
    status, incomplete = status_of(out.finish_reason)
    return {**base, "status": status, "incomplete_details": incomplete, "error": None, "output": output,
            "usage": usage(len(final.prompt_token_ids), len(out.token_ids), final.num_cached_tokens,
                           info.cache_writes(len(final.prompt_token_ids), final.num_cached_tokens))}


class ResponseEvents:
    """The event sequence of one streamed response: numbered, each output item opened, filled and
    closed in order (a message, then function calls), so that the `openai` client's accumulator ends
    with what a non-streamed request returns."""

    def __init__(self, base: dict) -> None:
        self.base, self.number, self.output = base, 0, []
        self.message: dict | None = None  # the open message item, while its text streams
        self.call: tuple[dict, ToolCall] | None = None  # the open function call item

    def event(self, kind: str, **fields) -> dict:
        self.number += 1
        return {"type": kind, "sequence_number": self.number - 1, **fields}

    def lifecycle(self, kind: str, **fields) -> dict:
        return self.event(kind, response={**self.base, "output": list(self.output), **fields})

    def text(self, piece: str, scores: list) -> list[dict]:
        events = [] if self.message else self._open_message()
        self.message["content"][0]["text"] += piece
        return events + [self.event("response.output_text.delta", item_id=self.message["id"], output_index=self._at(),
                                    content_index=0, delta=piece, logprobs=scores)]

    def tool_delta(self, delta: dict) -> list[dict]:
        """A chat-shaped tool_calls delta: a call's head (its id and name), or a piece of its arguments."""
        part = delta["tool_calls"][0]
        if "id" in part:
            events = self.close()
            call = ToolCall(part["function"]["name"], "", part["id"])
            item = call_item(call, "in_progress")
            self.call = item, call
            self.output.append(item)
            return events + [self.event("response.output_item.added", output_index=self._at(), item=dict(item))]
        item, call = self.call
        call.arguments += part["function"]["arguments"]
        item["arguments"] = call.arguments
        return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self._at(),
                           delta=part["function"]["arguments"])]

    def close(self, cut: bool = False, scores: list | None = None) -> list[dict]:
        """Close the open item (a call cut by the reply's end stays `incomplete`)."""
        events = []
        if self.message:
            item, at = self.message, self._at()
            part = item["content"][0]
            if scores is not None:
                part["logprobs"] = scores
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=part["text"], logprobs=scores or []),
                       self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=dict(part))]
            item["status"] = "completed"
            events.append(self.event("response.output_item.done", output_index=at, item=item))
            self.message = None
        elif self.call:
            item, _ = self.call
            item["status"] = "incomplete" if cut else "completed"
            events += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self._at(),
                                  name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=self._at(), item=item)]
            self.call = None
        return events

    def empty_message(self, scores: list | None) -> list[dict]:
        """A reply with neither text nor calls still answers with a message, as the whole response does."""
        return self._open_message() + self.close(scores=scores)

    def _open_message(self) -> list[dict]:
        self.message = message_item("", None, "in_progress", item_id("msg"))
        self.message["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        self.output.append(self.message)
        at = self._at()
        return [self.event("response.output_item.added", output_index=at, item={**self.message, "content": []}),
                self.event("response.content_part.added", item_id=self.message["id"], output_index=at,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _at(self) -> int:
        return len(self.output) - 1


async def response_events(stream, base: dict, info: ModelInfo, tools: bool, top_logprobs: int | None,
                          on_finish: Callable, keep: Callable[[dict], None]) -> AsyncIterator[dict]:
    """The events of one request's stream; `keep(response)` stores the finished response."""
    events = ResponseEvents(base)
    yield events.lifecycle("response.created", status="in_progress", usage=None)
    yield events.lifecycle("response.in_progress", status="in_progress", usage=None)
    parser = ToolCallParser() if tools else None
    async for out in stream:
        choice, new = out.outputs[0], out.delta_token_ids
        scores = (chat_logprobs(new, choice.logprobs[-len(new):], top_logprobs)["content"]
                  if top_logprobs is not None and new and parser is None else [])
        if parser is not None:
            deltas = parser.feed(out.delta_text)
        else:
            deltas = [{"content": out.delta_text}] if out.delta_text else []
        for delta in deltas:
            for event in events.text(delta["content"], scores) if "content" in delta else events.tool_delta(delta):
                yield event
        if choice.finish_reason == "error":
            message = out.error or "the request failed inside the engine"
            yield events.event("error", code="internal_error", message=message, param=None)
            yield events.lifecycle("response.failed", status="failed", usage=None,
                                   error={"code": "server_error", "message": message})
            return
        if not out.finished:
            continue
        tail = parser.finish() if parser else []
        for delta in tail:
            for event in events.text(delta["content"], []):
                yield event
        whole = finished_response(base, out, info, tools, top_logprobs)
        scores = whole["output"][0]["content"][0].get("logprobs") if whole["output"][0]["type"] == "message" else None
        closing = events.close(cut=bool(parser and parser.cut), scores=scores)
        if not events.output:
            closing = events.empty_message(scores)
        for event in closing:
            yield event
        whole["output"] = events.output  # the streamed items, ids and all
        on_finish(out)
        keep(whole)
        yield events.event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                           response=whole)


def stream_failure(message: str) -> dict:
    """The event that ends a stream the engine failed (it died, or refused mid-way)."""
    return {"type": "error", "code": "service_unavailable", "message": message, "param": None, "sequence_number": -1}
