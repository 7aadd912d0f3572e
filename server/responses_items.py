"""OpenAI's Responses API (/v1/responses) as a shape over the chat one: a request's `input` items
(messages, function calls and their outputs), `instructions`, `tools` and `text.format` become a
ChatCompletionRequest, and a finished reply becomes the response object's `output` items. What a
response stores for `previous_response_id` is its conversation as chat messages."""
from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import ParameterError
from engine.tool_calls import ToolCall
from server.content import joined_text, string_field
from server.protocol import ChatCompletionRequest, ResponseFormat, SamplingFields

TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
LOGPROBS = "message.output_text.logprobs"  # the one `include` value this server has something for
# SamplingFields that the Responses API names otherwise (or not at all): not passed on as they are.
RENAMED = {"n", "stream", "stream_options", "response_format", "max_tokens"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        if not isinstance(self.json_schema, dict):
            raise ParameterError("text.format with type json_schema needs `schema`, a JSON schema object.",
                                 "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema={"name": self.name, "schema": self.json_schema})


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    """POST /v1/responses. vLLM's sampling extras (top_k, min_p, repetition_penalty, seed, stop,
    priority, cache_salt, ...) are taken as on the chat route."""
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    reasoning: dict | None = None

    def check(self) -> None:
        """ParameterError for what this request asks that this server does not do, by name."""
        if self.background:
            raise ParameterError("background responses are not supported by this server; leave `background` out "
                                 "(or stream the response).", "background")
        if self.truncation == "auto":
            raise ParameterError("truncation \"auto\" is not supported: a conversation longer than the context is "
                                 "refused with the lengths; send truncation \"disabled\" or fewer items.",
                                 "truncation")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise ParameterError("this model does not reason: leave `reasoning` out.", "reasoning")
        if self.n != 1:
            raise ParameterError("the Responses API makes one output; for n samples use /v1/chat/completions.", "n")
        other = sorted(set(self.include or []) - {LOGPROBS})
        if other:
            raise ParameterError(f"include: {', '.join(other)} is not supported; this server can include only "
                                 f"{LOGPROBS}.", "include")

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The same request on the chat route: `instructions` as the first system message (never carried
        over to a later response), then the earlier responses' conversation, then this input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += input_messages(self.input, known_calls(history))
        if not messages:
            raise ParameterError("input is empty: give the user's message.", "input")
        fields = self.model_dump(include=set(SamplingFields.model_fields) - RENAMED, exclude_unset=True)
        extra = self.model_extra or {}
        fields.update({k: v for k, v in extra.items() if k not in ChatCompletionRequest.model_fields})
        wants_logprobs = LOGPROBS in (self.include or [])
        try:
            return ChatCompletionRequest(
                **fields, messages=messages, max_completion_tokens=self.max_output_tokens,
                logprobs=wants_logprobs, top_logprobs=self.top_logprobs if wants_logprobs else None,
                tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice),
                parallel_tool_calls=self.parallel_tool_calls,
                response_format=self.text.format.response_format() if self.text and self.text.format else None)
        except ValidationError as e:  # a message built from the items (their checks above catch the rest)
            first = e.errors()[0]
            raise ParameterError(f"input: {first['msg']}", "input") from None

    def settings(self, temperature: float, top_p: float) -> dict:
        """The response object's echo of the request (with the sampling values actually used)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "reasoning": None, "store": self.store, "temperature": temperature, "top_p": top_p,
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)
                         if self.text and self.text.format else {"type": "text"}},
                "tool_choice": self.tool_choice or "auto", "tools": self.tools or [],
                "top_logprobs": self.top_logprobs, "truncation": "disabled", "user": self.user,
                "metadata": self.metadata or {}, "background": False}


# ---- input items -> chat messages -----------------------------------------------------------
def input_messages(input: str | list[dict], calls: set[str] | None = None) -> list[dict]:
    """`input` (a string: one user message) -> chat messages. Function calls join the assistant message
    before them (or open one); a call's output becomes a tool message and must answer a call made
    before it (in `calls`, the earlier responses' call ids, or in this input)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    calls, out = set(calls or ()), []
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ParameterError(f"{where}.role must be user, system, developer or assistant, got {role!r}.",
                                     f"{where}.role")
            out.append({"role": role, "content": joined_text(item.get("content"), f"{where}.content", TEXT_PARTS)})
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            calls.add(call["id"])
        elif kind == "function_call_output":
            call_id = string_field(item, "call_id", where)
            if call_id not in calls:
                raise ParameterError(f"{where}.call_id {call_id!r} answers no function call made before it (in this "
                                     "input or the previous response).", f"{where}.call_id")
            output = joined_text(item.get("output"), f"{where}.output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise ParameterError(f"{where}: items of type {kind!r} are not supported; send messages, function_call "
                                 "and function_call_output items.", f"{where}.type")
    return out


def known_calls(messages: list[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or []}


# ---- tools: the Responses shape (flat) <-> the chat shape -----------------------------------
def chat_tools(tools: list | None) -> list | None:
    """{"type": "function", "name", "description", "parameters"} -> the chat route's nested shape."""
    if not tools:
        return tools
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ParameterError(f"tools[{i}]: only function tools are supported, got type {kind!r} (this server has "
                                 "no hosted tools).", f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if k in tool}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ---- a reply -> output items ----------------------------------------------------------------
def message_item(text: str, logprobs: list | None, status: str = "completed", id_: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": id_ or item_id("msg"), "status": status, "role": "assistant", "content": [part]}


def call_item(call: ToolCall, status: str = "completed", id_: str | None = None) -> dict:
    return {"type": "function_call", "id": id_ or item_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, written_tokens: int) -> dict:
    """`written_tokens`: prompt tokens this request added to the prefix cache (ModelInfo.cache_writes)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": written_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a response whose reply ended for `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None
