"""How stored messages are shown: the chat's messages with their footers (the demo's engine
figures, the customer's times), a reply's tool calls folded under it and its sources, the reply
being written."""
from __future__ import annotations

import html
import re
import time

from ui import links

TYPING = {"role": "assistant", "content": "*typing…*"}  # shown under a sent message until the reply starts


def author_name(m: dict) -> str | None:
    """The person who wrote an assistant-side message ("agent:NAME"), None for the model."""
    author = m.get("author") or ""
    return author.removeprefix("agent:") if author.startswith("agent:") else None


def reply_footer(m: dict) -> str:
    person = author_name(m)
    if person:
        return f"\n\n<sub>{stamp(m)} · {person}, a person from our team</sub>"
    if m.get("generated_tokens") is None:
        return ""
    ttft = f"TTFT {m['ttft'] * 1000:.0f} ms · " if m.get("ttft") is not None else ""
    speed = f"{m['tokens_per_s']:.1f} tok/s · " if m.get("tokens_per_s") else ""
    stopped = {"abort": " · stopped", "interrupted": " · interrupted (the server or its engine went away)",
               "streaming": " · still being written"}.get(m.get("finish_reason"), "")
    return (f"\n\n<sub>{stamp(m)} · {ttft}{speed}prompt {m['prompt_tokens']} (cached {m['cached_tokens']}) · "
            f"{m['generated_tokens']} generated{stopped}</sub>")


def user_footer(m: dict) -> str:
    trimmed = m.get("trimmed_turns") or 0
    note = (f" · the {trimmed} oldest messages were left out of this turn to fit the model's context"
            if trimmed else "")
    return f"\n\n<sub>{stamp(m)}{note}</sub>"


def stamp(m: dict) -> str:
    """When a message was written, in the server's local time (the date too if not today)."""
    created = time.localtime(m["created"])
    today = time.localtime().tm_yday == created.tm_yday and time.localtime().tm_year == created.tm_year
    return time.strftime("%H:%M" if today else "%d %b %H:%M", created)


def tool_lines(calls: list[dict], running: bool = False) -> str:
    """A reply's tool calls, folded under it: what was asked and what came back; a failure also as
    a line of its own. `running`: a call is being written or run."""
    parts = []
    for c in calls:
        if c.get("error"):
            parts.append(f"⚠ {html.escape(c['error'])}")
        result = "…" if c.get("result") is None else html.escape(c["result"])
        parts.append(f"<details><summary>Tool · {c['name']}</summary>\n\n<code>{html.escape(c['arguments'])}</code>"
                     f"\n\n→ {result}\n\n</details>")
    if running and not calls:
        parts.append("Tool · …")
    return ("\n\n" + "\n\n".join(parts)) if parts else ""


def source_lines(sources: list[dict]) -> str:
    """Where a reply's knowledge came from: each chunk's document and section, a link that opens it."""
    if not sources:
        return ""
    links = " · ".join(f"[{n}] [{html.escape(s['document'])}{' › ' + html.escape(s['section']) if s['section'] else ''}]"
                       f"({s['url']})" if s.get("url") else f"[{n}] {html.escape(s['document'])}"
                       for n, s in enumerate(sources, 1))
    return f"\n\n<small>{links}</small>"


def in_flight(text: str, calls: list[dict], running: bool) -> dict:
    """The reply as it is being written (or its tool runs), as a message display() and
    customer_display() show after the stored ones: without a footer."""
    return {"role": "assistant", "content": text or "", "tool_calls": calls, "running": running}


def text_of(m: dict) -> str:
    """A message's text as the chat may render it: a customer's own words are text, never markup
    (a typed <form>, <input> or <details> shows as typed); replies keep their Markdown."""
    return html.escape(m["content"], quote=False) if m["role"] == "user" else m["content"]


def display(messages: list[dict], hosts: frozenset[str] | None = None) -> list[dict]:
    """Stored messages -> gr.Chatbot's list of {"role", "content"}, with their footers; replies as
    the model wrote them (`hosts` is the customer chat's, ui/links.py)."""
    def footer(m: dict) -> str:
        if "running" in m:
            return ""
        return reply_footer(m) if m["role"] == "assistant" else user_footer(m)
    return [{"role": m["role"], "content": text_of(m) + tool_lines(m.get("tool_calls") or [], m.get("running", False))
             + source_lines(m.get("sources") or []) + footer(m)} for m in messages]


CUT = ("abort", "interrupted", "streaming", "length")  # stopped, cut, unfinished, at max_tokens: not ended


def customer_display(messages: list[dict], hosts: frozenset[str] | None = None) -> list[dict]:
    """The customer chat's view: each message with its time only (and the person who wrote a reply,
    if one did); no engine figures, and nothing in words, so it reads the same in any language: a
    reply that did not end (stopped, cut by a restart, or at its token limit) ends in an ellipsis.
    A reply's addresses are links only where `hosts` (the assistant's) or the chat vouches for them
    (ui/links.py)."""
    vouched = (hosts or frozenset()) | links.chat_hosts(messages)

    def footer(m: dict) -> str:
        if "running" in m:
            return ""
        person = author_name(m) if m["role"] == "assistant" else None
        return f"\n\n<sub>{stamp(m)}{f' · 👤 {person}' if person else ''}</sub>"

    def text(m: dict) -> str:
        if m["role"] == "user":
            return text_of(m)
        shown = m["content"] if author_name(m) else links.guard(m["content"], vouched)
        cut = m.get("finish_reason") in CUT and not shown.rstrip().endswith("…")
        return shown.rstrip() + " …" if cut else shown
    return [{"role": m["role"], "content": text(m) + tool_lines(m.get("tool_calls") or [], m.get("running", False))
             + source_lines(m.get("sources") or []) + footer(m)} for m in messages]


FOOTER = re.compile(r"\n\n<sub>.*</sub>\s*$", re.S)


def plain_text(content) -> str:
    """A chatbot value (a string, or content parts from the browser) without our footer, as the
    customer typed it (text_of's escaping undone)."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return html.unescape(FOOTER.sub("", str(content or "")))


def feedback_values(messages: list[dict]) -> list[str | None]:
    """gr.Chatbot's feedback_value: one entry per assistant message."""
    return [{1: "Like", -1: "Dislike"}.get(m.get("feedback")) for m in messages if m["role"] == "assistant"]


def event_index(data) -> int | None:
    """The message a chatbot event (a thumb, an edit) names: gr.LikeData's or gr.EditData's index,
    None for anything else (an API client's made-up value)."""
    index = getattr(data, "index", None)
    index = index[0] if isinstance(index, (list, tuple)) and index else index
    return index if isinstance(index, int) else None
