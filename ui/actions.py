"""An assistant's tools in the chat: what an operator configures, and running a call. A tool is a
built-in (lookup_order over the orders table, handoff to a person) or an HTTP endpoint (URL, method,
JSON schema of its arguments, timeout, optional secret header read from a file). Running one never
raises: it is bounded in time, its result is capped, and a failure becomes a result the model reads
({"error": ...}) and a line the chat shows.

`when`: a regular expression; when a customer's message matches it, that turn's first step must call
the tool (tool_choice names it). Small models rarely call tools unprompted (SmolLM2-135M never did
in auto on our prompts); a trigger makes the lookup happen, and the grammar still makes its arguments
valid. Without `when`, the model decides (auto)."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable

from engine.errors import ParameterError
from engine.tools import NAME, Tool, parse_tools
from storage import orders

MAX_TOOLS, MAX_RESULT_CHARS, MAX_TIMEOUT_S, DEFAULT_TIMEOUT_S = 8, 2000, 30.0, 5.0

BUILTINS = {
    "lookup_order": Tool("lookup_order", "an order's status, items, carrier, tracking and delivery date",
                         {"type": "object", "properties": {"order_id": {"type": "string", "pattern": r"^[A-Z]{2}-?[0-9]{8}$"}},
                          "required": ["order_id"], "additionalProperties": False}),
    "handoff": Tool("handoff", "hand the chat to a person from the team",
                    {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 200}},
                     "required": ["reason"], "additionalProperties": False}),
}
DEFAULT_TOOLS = [{"builtin": "lookup_order", "when": orders.ORDER_ID.pattern}, {"builtin": "handoff"}]


@dataclass
class ChatTool:
    tool: Tool
    when: re.Pattern | None
    config: dict  # the operator's entry

    @property
    def name(self) -> str:
        return self.tool.name


def check(entries) -> list[dict]:
    """An assistant's tool entries, cleaned; ParameterError naming what is wrong."""
    if isinstance(entries, str):
        try:
            entries = json.loads(entries) if entries.strip() else []
        except ValueError as e:
            raise ParameterError(f"tools must be JSON (a list of tool entries): {e}", "tools") from None
    entries = entries or []
    if not isinstance(entries, list) or len(entries) > MAX_TOOLS:
        raise ParameterError(f"tools must be a list of at most {MAX_TOOLS} entries", "tools")
    cleaned = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ParameterError(f"tools[{i}] must be an object", "tools")
        if "when" in e and e["when"]:
            try:
                re.compile(e["when"])
            except re.error as err:
                raise ParameterError(f"tools[{i}].when is not a regular expression: {err}", "tools") from None
        if "builtin" in e:
            if e["builtin"] not in BUILTINS:
                raise ParameterError(f"tools[{i}].builtin must be one of {sorted(BUILTINS)}, got {e['builtin']!r}",
                                     "tools")
            cleaned.append({k: e[k] for k in ("builtin", "when") if e.get(k)})
            continue
        name, url = e.get("name"), e.get("url")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ParameterError(f"tools[{i}].name must be 1-64 letters, digits, _ or -", "tools")
        if not isinstance(url, str) or urllib.parse.urlparse(url).scheme not in ("http", "https"):
            raise ParameterError(f"tools[{i}].url must be an http(s) URL, got {url!r}", "tools")
        method = str(e.get("method") or "POST").upper()
        if method not in ("GET", "POST"):
            raise ParameterError(f"tools[{i}].method must be GET or POST", "tools")
        timeout = e.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ParameterError(f"tools[{i}].timeout_s must be in (0, {MAX_TIMEOUT_S:g}]", "tools")
        entry = {"name": name, "description": str(e.get("description") or ""), "url": url, "method": method,
                 "parameters": e.get("parameters") or {"type": "object", "properties": {}}, "timeout_s": timeout}
        entry.update({k: str(e[k]) for k in ("secret_file", "secret_header", "when") if e.get(k)})
        cleaned.append(entry)
    names = [BUILTINS[e["builtin"]].name if "builtin" in e else e["name"] for e in cleaned]
    if len(set(names)) != len(names):
        raise ParameterError(f"tools: a name is given twice ({names})", "tools")
    try:  # the schemas compile into a grammar
        parse_tools([_tool(e).openai() for e in cleaned])
    except ParameterError as err:
        raise ParameterError(f"tools: {err}", "tools") from None
    return cleaned


def _tool(entry: dict) -> Tool:
    if "builtin" in entry:
        return BUILTINS[entry["builtin"]]
    return Tool(entry["name"], entry["description"], entry["parameters"])


def chat_tools(entries: list[dict]) -> list[ChatTool]:
    return [ChatTool(_tool(e), re.compile(e["when"], re.I) if e.get("when") else None, e) for e in entries or []]


def triggered(tools: list[ChatTool], text: str, said: str = "") -> ChatTool | None:
    """The first tool whose `when` matches the customer's message; or the built-in lookup_order when
    the message gives an e-mail address and the customer wrote an order number in this chat (`said`:
    all they wrote), which is how they answer its question for the address."""
    hit = next((t for t in tools if t.when is not None and t.when.search(text or "")), None)
    if hit is None and orders.EMAIL.search(text or "") and orders.ORDER_ID.search(said or ""):
        hit = next((t for t in tools if t.config.get("builtin") == "lookup_order"), None)
    return hit


def narrowed(tools: list[Tool], said: str) -> list[Tool]:
    """The tools as this turn's grammar holds the model to them: lookup_order's order_id one of the
    order numbers the customer wrote in this chat (so the model cannot invent or mistype one), where
    they wrote any. The prompt keeps the tools as they are, so its cached blocks stay the same."""
    numbers = sorted({orders.normalise(n) for n in orders.ORDER_ID.findall(said or "")})
    if not numbers:
        return tools
    schema = {"type": "object", "properties": {"order_id": {"enum": numbers}}, "required": ["order_id"],
              "additionalProperties": False}
    return [Tool(t.name, t.description, schema) if t is BUILTINS["lookup_order"] else t for t in tools]


@dataclass
class ToolResult:
    text: str  # what the model reads
    error: str | None = None  # a line for the chat, when the tool failed
    seconds: float = 0.0


def run(tool: ChatTool, arguments: str, store, handoff: Callable[[str], None], said: str = "") -> ToolResult:
    """Run one call; never raises. handoff(reason): the chat's own handoff to a person. said: all
    the customer has written in this chat (lookup_order's proof of whose order it is)."""
    start = time.monotonic()
    try:
        args = json.loads(arguments)
        if "builtin" in tool.config:
            text = _builtin(tool.name, args, store, handoff, said)
        else:
            text = _http(tool.config, args)
        error = None
    except Exception as e:  # noqa: BLE001 - every failure is reported to the model and the chat, none crashes
        error = _describe(e, tool)
        text = json.dumps({"error": error}, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + " …(cut)"
    return ToolResult(text, error, time.monotonic() - start)


def _builtin(name: str, args: dict, store, handoff, said: str) -> str:
    if name == "lookup_order":
        return orders.answer(store, args["order_id"], said)
    handoff(str(args.get("reason") or ""))
    return "A person from the team has been asked to join this chat; tell the customer they will be with them shortly."


def _http(config: dict, args: dict) -> str:
    headers = {"Accept": "application/json", "User-Agent": "pagedchat-tool"}
    if config.get("secret_file"):
        with open(config["secret_file"], encoding="utf-8") as f:
            headers[config.get("secret_header") or "Authorization"] = f.read().strip()
    url, data = config["url"], None
    if config["method"] == "GET":
        url += ("&" if "?" in url else "?") + urllib.parse.urlencode(
            {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()})
    else:
        data, headers["Content-Type"] = json.dumps(args).encode(), "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=config["method"])
    with urllib.request.urlopen(request, timeout=config["timeout_s"]) as response:
        body = response.read(MAX_RESULT_CHARS * 4 + 1)
    if len(body) > MAX_RESULT_CHARS * 4:
        raise ValueError(f"{config['name']} answered more than {MAX_RESULT_CHARS * 4} bytes")
    text = body.decode("utf-8")
    json.loads(text)  # a tool must answer JSON; anything else is reported as garbage
    return text


def _describe(e: Exception, tool: ChatTool) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"{tool.name} answered HTTP {e.code} {e.reason}"
    if isinstance(e, TimeoutError) or "timed out" in str(e):
        return f"{tool.name} did not answer within {tool.config.get('timeout_s', DEFAULT_TIMEOUT_S):g} s"
    if isinstance(e, (UnicodeDecodeError, json.JSONDecodeError)) and not isinstance(e, ParameterError):
        return f"{tool.name} answered something that is not JSON"
    if isinstance(e, urllib.error.URLError):
        return f"{tool.name} could not be reached: {e.reason}"
    if isinstance(e, OSError):
        return f"{tool.name} failed: {e.strerror or e}"
    return f"{tool.name} failed: {e}"
