"""Reading a reply back into OpenAI's shape: content and tool calls, streamed piece by piece or
whole, the same either way. A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(engine/tools.py constrains it); no call text ever reaches the content."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments, exactly as the model wrote it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class ToolCallParser:
    """A reply -> content deltas and calls, fed text as it streams. `feed` returns OpenAI delta
    parts: {"content": ...} and {"tool_calls": [{index, id, type, function: {name, arguments}}]}
    (the head first, then argument fragments). Text that may be the start of the opening tag, and
    whitespace before it, is held back until it is known not to be: streamed content is the whole
    reply's content, stripped."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []  # complete calls
        self.cut: ToolCall | None = None  # at finish(): a call the reply's end cut short (max_tokens)
        self.content = ""
        self._buffer = ""
        self._state = "text"  # text -> head -> args -> tail -> between -> head ...
        self._call: ToolCall | None = None
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        out: list[dict] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict]:
        """At the end of the reply: held-back text was content after all. A call cut short after its name
        is kept in `cut`, its arguments as far as they were written (and streamed): OpenAI's reply to a
        call cut by max_tokens. One cut inside its name has streamed nothing and is dropped."""
        if self._state in ("args", "tail"):
            self.cut = self._call
        if self._state == "text" and self._buffer.strip():
            piece, self._buffer = self._buffer.rstrip(), ""
            return self._content(piece)
        return []

    @property
    def in_call(self) -> bool:
        """Whether the reply has started a call (everything from its opening tag on is not content)."""
        return self._state != "text"

    def _content(self, piece: str) -> list[dict]:
        if not self.content.strip():
            piece = piece.lstrip()
        self.content += piece
        return [{"content": piece}] if piece else []

    def _step(self, out: list[dict]) -> bool:
        b = self._buffer
        if self._state in ("text", "between"):
            at = b.find(OPEN)
            if at < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(b)), 0, -1) if OPEN.startswith(b[-k:])), 0)
                keep += len(b[:len(b) - keep]) - len(b[:len(b) - keep].rstrip())  # and whitespace before it
                if self._state == "text":
                    out += self._content(b[:len(b) - keep])
                self._buffer = b[len(b) - keep:]
                return False
            if self._state == "text":
                out += self._content(b[:at].rstrip())
            self._buffer, self._state = b[at + len(OPEN):], "head"
            return True
        if self._state == "head":
            m = _HEAD.match(b)
            if not m:
                return False
            self._call = ToolCall(m.group(1), "")
            index = len(self.calls)
            out.append({"tool_calls": [{"index": index, "id": self._call.id, "type": "function",
                                        "function": {"name": self._call.name, "arguments": ""}}]})
            self._buffer, self._state = b[m.end():], "args"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "args":
            end = self._scan(b)
            piece = b if end is None else b[:end]
            if piece:
                self._call.arguments += piece
                out.append({"tool_calls": [{"index": len(self.calls), "function": {"arguments": piece}}]})
            self._buffer = "" if end is None else b[end:]
            if end is None:
                return False
            self._state = "tail"
            return True
        at = b.find(CLOSE)  # tail: the wrapper's "}" and the closing tag
        if at < 0:
            return False
        self.calls.append(self._call)
        self._buffer, self._state = b[at + len(CLOSE):], "between"
        return True

    def _scan(self, text: str) -> int | None:
        """Where the arguments' JSON value ends in `text` (continuing the scan), or None."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
            elif self._depth == 0 and ch in ",}":
                return i
        return None


def read_reply(text: str) -> ToolCallParser:
    """A whole reply, read: its `content`, its complete `calls` and the `cut` one, if any."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser


def parse_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (content or None, its calls: the complete ones, then one cut short if any)."""
    reply = read_reply(text)
    return (reply.content.strip() or None), reply.calls + ([reply.cut] if reply.cut else [])
