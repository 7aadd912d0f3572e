"""Anthropic's Messages API (/v1/messages, as vLLM and llama.cpp's server serve it) as a shape over the
chat route: `system`, `messages` with text, tool_use and tool_result blocks, `tools` with their
`input_schema` and `tool_choice` become a ChatCompletionRequest; a finished reply becomes content
blocks, a stop reason and Anthropic's usage (input tokens not counting those read from or written
to the prefix cache)."""
from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError

from engine.errors import ParameterError
from engine.tool_calls import ToolCall, read_reply
from server.content import joined_text, string_field
from server.protocol import ChatCompletionRequest, UnicodeBody

CHOICES = {"auto": "auto", "any": "required", "none": "none"}
TEXT = {"text": "text"}  # text blocks, joined by newlines (each block is a paragraph of its own)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessagesRequest(UnicodeBody):
    """POST /v1/messages (and /v1/messages/count_tokens, which needs no max_tokens)."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range, unlike OpenAI's 0-2
    top_p: float | None = None
    top_k: int | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": {...}}}

    def check(self) -> None:
        """ParameterError for what this request asks that this server does not do, by name."""
        if self.thinking and self.thinking.get("type") not in (None, "disabled"):
            raise ParameterError("this model does not think: leave `thinking` out (or set its type to disabled).",
                                 "thinking")
        if (self.output_config or {}).get("effort") is not None:
            raise ParameterError("this model does not reason: leave output_config.effort out.",
                                 "output_config.effort")
        # cache_control: prefixes are cached whether marked or not
        unknown = sorted(set(self.model_extra or {}) - {"service_tier", "cache_control"})
        if unknown:
            raise ParameterError(f"`{unknown[0]}` is not supported by this server; leave it out of the request.",
                                 unknown[0])

    def chat_request(self) -> ChatCompletionRequest:
        self.check()
        system = joined_text(self.system, "system", TEXT, "\n") if self.system is not None else None
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages)
        choice = self.tool_choice or {}
        kind = choice.get("type", "auto")
        if kind not in (*CHOICES, "tool"):
            raise ParameterError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}.", "tool_choice.type")
        user = (self.metadata or {}).get("user_id")
        # a last assistant turn is a prefill: the reply continues it (Anthropic's rule), not a new turn
        prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
        try:
            return ChatCompletionRequest(
                model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences, tools=chat_tools(self.tools),
                tool_choice=({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                             else CHOICES[kind]) if self.tools else None,
                parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
                response_format=self.response_format(), user=user if isinstance(user, str) else None,
                add_generation_prompt=not prefill, continue_final_message=prefill)
        except ValidationError as e:
            first = e.errors()[0]
            raise ParameterError(f"messages: {first['msg']}", "messages") from None


    def response_format(self) -> dict | None:
        """output_config.format (JSON outputs) as the chat route's response_format."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ParameterError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                                 "output_config.format")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1


# ---- messages -> chat messages --------------------------------------------------------------
def chat_messages(messages: list[dict]) -> list[dict]:
    """Anthropic's turns -> chat messages: an assistant's tool_use blocks become its tool_calls, and a
    user's tool_result blocks become tool messages (before the user's text), each answering a call
    made before it."""
    out, calls = [], set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ParameterError(f"{where}.role must be user or assistant, got {role!r} (the system prompt goes in "
                                 "`system`).", f"{where}.role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ParameterError(f"{where}.content must be a string or a list of content blocks.", f"{where}.content")
        texts, tool_calls = [], []
        for j, block in enumerate(blocks):
            at, kind = f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                call_id, name = string_field(block, "id", at), string_field(block, "name", at)
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                tool_calls.append({"id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}})
                calls.add(call_id)
            elif kind == "tool_result" and role == "user":
                call_id = string_field(block, "tool_use_id", at)
                if call_id not in calls:
                    raise ParameterError(f"{at}.tool_use_id {call_id!r} answers no tool_use block before it.",
                                         f"{at}.tool_use_id")
                result = joined_text(block.get("content", ""), f"{at}.content", TEXT, "\n")
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": f"Error: {result}" if block.get("is_error") else result})
            else:
                raise ParameterError(f"{at}: a {role} message cannot hold a block of type {kind!r} here (this model "
                                     "reads text; tool_use goes in assistant turns, tool_result in user turns).", at)
        if texts or tool_calls or not blocks:
            message = {"role": role, "content": "\n".join(texts)}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out.append(message)
    return out


def chat_tools(tools: list | None) -> list | None:
    """{"name", "description", "input_schema"} -> the chat route's function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ParameterError(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported, "
                                 f"got type {kind!r}.", f"tools[{i}]")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                     "parameters": tool.get("input_schema")}})
    return out


# ---- a reply -> the message ---------------------------------------------------------------------
def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments or "{}")}


def reply_blocks(text: str, tools: bool) -> list[dict]:
    """A whole reply's content blocks: its text, then its complete calls (one cut short by max_tokens
    has no whole input and is left out)."""
    if not tools:
        return [{"type": "text", "text": text}]
    reply = read_reply(text)
    content = reply.content.strip()
    return ([{"type": "text", "text": content}] if content or not reply.calls else []) + [
        tool_use(c) for c in reply.calls]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_of(out, has_calls: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return ("tool_use" if has_calls else "end_turn"), None


def usage(prompt_tokens: int, output_tokens: int, cached: int, written: int) -> dict:
    """Anthropic counts input tokens apart from those read from and written to the cache."""
    return {"input_tokens": prompt_tokens - cached - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}
