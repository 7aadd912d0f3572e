"""Tool calling in OpenAI's shape, made unbreakable by the grammar. A call is written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen format); llguidance
constrains it, so a started call always completes with arguments valid for the tool's schema:

- `required`: the reply is one or more calls; a named function: exactly one call of it;
- `auto`: text that never contains the opening tag, or text then calls (from the tag on, constrained);
- `none`: free text, and the tools are left out of the prompt.

Templates that know tools (`tools` in their source: Qwen, Llama 3.1, ...) render them themselves.
For the rest (SmolLM2) the generic format: the tool list and the call format are appended to the
system message, a past call is the assistant's text in the call format, and a tool's result is a
user turn `<tool_response>...</tool_response>`. engine/tool_calls.py reads replies back."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from engine.errors import ParameterError
from engine.tool_calls import CLOSE, OPEN

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")
# A call is written as json.dumps writes it (one line, ", " and ": "): fewer tokens than the
# newlines small models put between keys, and a past call re-renders token for token.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CALLS = 8  # calls in one reply: small models otherwise repeat calls until max_tokens


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the prompt and of decoding."""
    tools: list[Tool]
    choice: str  # "auto" | "none" | "required" | a tool's name
    parallel: bool = True

    @functools.cached_property
    def grammar(self) -> str | None:
        return None if self.choice == "none" else call_grammar(self.tools, self.choice, self.parallel)

    @property
    def prompt_tools(self) -> list[Tool]:
        return [] if self.choice == "none" else self.tools


def parse_tools(tools: list | None, tool_choice: object = None, parallel: bool = True) -> ToolPlan | None:
    """OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` checked; ParameterError naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ParameterError("tool_choice needs `tools`: give the functions it may call.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ParameterError("tools must be a list of {\"type\": \"function\", \"function\": {...}}.", "tools")
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ParameterError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 "\"parameters\": {...}}}}.", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ParameterError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}.",
                                 f"{where}.function.name")
        if any(t.name == name for t in parsed):
            raise ParameterError(f"{where}.function.name {name!r} is given twice.", f"{where}.function.name")
        parameters = fn.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ParameterError(f"{where}.function.parameters must be a JSON schema of an object "
                                 f"(\"type\": \"object\"), got {json.dumps(parameters)[:200]}.",
                                 f"{where}.function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ParameterError(f"{where}.function.description must be a string.", f"{where}.function.description")
        tool = Tool(name, description, parameters)
        _check_schema(tool, f"{where}.function.parameters")
        parsed.append(tool)
    return ToolPlan(parsed, _choice(tool_choice, parsed), bool(parallel))


def _check_schema(tool: Tool, where: str) -> None:
    """llguidance's own complaint about a schema it cannot compile, naming the field."""
    import llguidance

    M = llguidance.LLMatcher
    problem = M.validate_grammar(M.grammar_from_json_schema(_call_schema(tool)))
    if problem:
        lines = [line.strip() for line in problem.strip().splitlines()]
        shown = lines[:next((i for i, line in enumerate(lines) if re.match(r"\d+ \|", line)), len(lines))]
        reason = " ".join(shown).removeprefix("failed to compile JSON schema: ")
        raise ParameterError(f"{where} cannot be compiled into a grammar: {reason}", where)


def _choice(tool_choice: object, tools: list[Tool]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ParameterError(f"tool_choice must be one of {CHOICES} or {{\"type\": \"function\", \"function\": "
                                 f"{{\"name\": ...}}}}, got {tool_choice!r}.", "tool_choice")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise ParameterError("tool_choice must name a function: {\"type\": \"function\", \"function\": "
                             "{\"name\": ...}}.", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ParameterError(f"tool_choice names {name!r}, which is not among the tools "
                             f"({', '.join(t.name for t in tools)}).", "tool_choice")
    return name


# ---- the grammar ----------------------------------------------------------------------------
def _call_schema(tool: Tool) -> dict:
    """{"name": <const>, "arguments": <the tool's schema>}, name first; the tool's $defs move to the
    root so its "#/$defs/..." references still resolve."""
    arguments = {k: v for k, v in tool.parameters.items() if k not in ("$defs", "definitions")}
    arguments.setdefault("type", "object")
    schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": COMPACT}
    for key in ("$defs", "definitions"):
        if key in tool.parameters:
            schema[key] = tool.parameters[key]
    return schema


def call_grammar(tools: list[Tool], choice: str, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `choice`."""
    allowed = [t for t in tools if choice in ("auto", "required") or t.name == choice]
    bodies = "\n".join(f"body_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(allowed))
    more = f' ("\\n"? "{OPEN}" one){{0,{MAX_CALLS - 1}}}' if parallel and choice in ("auto", "required") else ""
    rules = [f"calls: one{more}",  # what follows the first opening tag
             f'one: "\\n"? body "\\n"? "{CLOSE}"',
             "body: " + " | ".join(f"body_{i}" for i in range(len(allowed))),
             bodies]
    if choice == "auto":
        rules[:0] = ["start: TEXT | lead calls",
                     f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(OPEN)}.*)/",
                     f"lead[lazy]: /(?s:.*){re.escape(OPEN)}/"]
    else:
        rules.insert(0, f'start: "{OPEN}" calls')
    return "\n".join(rules) + "\n"


# A reply that may not call (the chat's answer after a tool result): any text without the opening tag.
NO_CALL_GRAMMAR = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(OPEN)}.*)/\n"


# ---- the prompt -----------------------------------------------------------------------------
def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render(tokenizer, messages: list[dict], plan: ToolPlan | None = None, add_generation_prompt: bool = True,
           **template_kwargs) -> list[int]:
    """A conversation (with tools, calls and results, if any) -> prompt token ids, through the
    model's chat template (ParameterError for a tool message without its call)."""
    msgs, extra = template_inputs(messages, plan, template_knows_tools(tokenizer))
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def generic_tools_text(tools: list[Tool]) -> str:
    """The tools in the system message, one line each (`name(arg: type, ...): description`): the
    grammar holds the arguments to the schema, so the prompt needs only what each tool is for."""
    lines = "\n".join(f"- {t.name}({_signature(t.parameters)}): {t.description}".rstrip(": ") for t in tools)
    return (f"\n\nYou can call these tools:\n{lines}\nTo call one, reply with only "
            f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}; its result comes back as <tool_response>.')


def _signature(schema: dict) -> str:
    props = schema.get("properties") or {}
    return ", ".join(f"{name}: {spec.get('type') or 'any'}" if isinstance(spec, dict) else name
                     for name, spec in props.items())


def call_text(name: str, arguments: str | dict) -> str:
    """A call in the generic format, as the model writes it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}{{"name": "{name}", "arguments": {args}}}{CLOSE}'


def check_tool_messages(messages: list[dict]) -> None:
    """Each tool message answers a call made earlier in the conversation (OpenAI's rule)."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ParameterError(f"messages[{i}].tool_calls entries need function.name and function.arguments.",
                                     f"messages[{i}].tool_calls")
            calls.add(call.get("id"))
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            raise ParameterError(f"messages[{i}] (role tool) has tool_call_id {m.get('tool_call_id')!r}, which no "
                                 "earlier assistant message's tool_calls has.", f"messages[{i}].tool_call_id")


def template_inputs(messages: list[dict], plan: ToolPlan | None, native: bool) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) for a conversation that may carry tools."""
    check_tool_messages(messages)
    tools = plan.prompt_tools if plan else []
    if native:
        out = [_native(m) for m in messages]
        return out, ({"tools": [t.openai() for t in tools]} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("call_text"):  # the chat's own record: the text the model wrote, exactly
            out.append({"role": "assistant", "content": m["call_text"]})
        elif m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"].get("arguments") or "{}")
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content"), calls) if x)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        text = generic_tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + text}
        else:
            out.insert(0, {"role": "system", "content": text.lstrip()})
    return out, {}


def _native(m: dict) -> dict:
    """A message as HF templates read it: a call's arguments as a dict."""
    out = {k: v for k, v in m.items() if v is not None and k != "call_text"}
    out.setdefault("content", "")
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_dict(c["function"].get("arguments"))}}
                             for c in m["tool_calls"]]
    return out


def _as_dict(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
