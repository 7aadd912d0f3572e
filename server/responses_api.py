"""/v1/responses (OpenAI's Responses API, as vLLM serves it): create a response, whole or streamed;
retrieve, delete and list the input items of a stored one. A request is turned into the chat
route's (server/responses_items.py) and runs through the same rendering, sampling and engine.

Stored responses (`store`, true by default) live in this process's memory, the newest
`ResponseStore.keep` of them, each readable only with the API key that made it: `previous_response_id`
continues a conversation without resending it (its prompt is then a prefix-cache hit), and a
restart forgets them (404 naming the id)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request

from server.deps import check_key, finish_logger, generation, prepare_chat
from server.errors import APIError
from server.replies import now
from server.responses_items import ResponsesRequest, input_messages, item_id, known_calls
from server.responses_stream import finished_response, response_events, stream_failure
from server.streaming import collect, finish_reason, sse, started


@dataclass
class Stored:
    owner: str | None  # the API key's name (None without keys)
    response: dict
    input_items: list[dict]  # this request's input, each item with an id
    conversation: list[dict]  # chat messages through this response's output, without its instructions


class ResponseStore:
    """The newest `keep` responses, in memory (the event loop's thread alone touches it). Each is at
    most a context's worth of text (its conversation was a prompt plus its reply, within max_model_len
    tokens): ~100 KB at 8192 tokens, so the store stays within ~100 MB."""

    def __init__(self, keep: int = 1000) -> None:
        self.keep, self.items = keep, OrderedDict()

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        while len(self.items) > self.keep:
            self.items.popitem(last=False)

    def get(self, response_id: str, owner: str | None, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None or stored.owner != owner:
            raise APIError(404, f"Response with id '{response_id}' not found (responses are kept in memory, the "
                                f"newest {self.keep}, until the server restarts; one made with store: false is not "
                                "kept).", "invalid_request_error", param)
        return stored

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner)
        del self.items[response_id]


router = APIRouter(dependencies=[Depends(check_key)])


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    body.check()
    store: ResponseStore = request.app.state.responses
    owner = request.state.key_name
    history = (store.get(body.previous_response_id, owner, "previous_response_id").conversation
               if body.previous_response_id else [])
    chat = body.chat_request(history)
    client, info, name, ids, params = await prepare_chat(request, chat)
    tools = chat.tool_plan is not None and chat.tool_plan.grammar is not None
    rid = item_id("resp")
    base = {"id": rid, "object": "response", "created_at": now(), "model": name,
            **body.settings(params.temperature, params.top_p)}
    asked = [m.as_dict() for m in chat.messages][1 if body.instructions else 0:]

    def keep(response: dict) -> None:
        if body.store:
            conversation = asked + input_messages(response["output"], known_calls(asked))
            store.put(Stored(owner, response, input_items(body.input), conversation))

    on_finish = finish_logger(request, len(ids), chat.messages)
    stream = generation(request, client, ids, params, rid, chat)
    if body.stream:
        return sse(response_events(await started(stream), base, info, tools, params.logprobs, on_finish, keep),
                   stream_failure, typed=True)
    final = await collect(stream, request)
    on_finish(final)
    finish_reason(final.outputs[0], final.error)  # an engine failure is a 500 saying why
    response = finished_response(base, final, info, tools, params.logprobs)
    keep(response)
    return response


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return request.app.state.responses.get(response_id, request.state.key_name).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    request.app.state.responses.delete(response_id, request.state.key_name)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                           after: str | None = None):
    """OpenAI's page of a response's input items: newest first by default, `after` an item id."""
    if not 1 <= limit <= 100 or order not in ("asc", "desc"):
        raise APIError(400, "limit must be 1-100 and order asc or desc.", "invalid_request_error",
                       "limit" if order in ("asc", "desc") else "order")
    items = request.app.state.responses.get(response_id, request.state.key_name).input_items
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"after: no input item {after!r} in this response.", "invalid_request_error", "after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def input_items(input: str | list[dict]) -> list[dict]:
    """A request's input as OpenAI lists it: each item with an id, a message's content as parts (a
    string input is one user message)."""
    if isinstance(input, str):
        input = [{"role": "user", "content": input}]
    items = []
    for item in input:
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "content": [{"type": part, "text": item["content"]}]}
        made = item_id("fc" if kind == "function_call" else "msg")
        items.append({**item, "type": kind, "id": item.get("id") or made})
    return items
