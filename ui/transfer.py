"""Chats and feedback in and out as files: a chat as Markdown or JSON (the JSON imports back as a
new chat, token ids included, so the next turn still reuses the cache), rated replies as CSV or
JSONL for the weekly review."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
import time

FORMAT = "pagedchat.chat/1"
MAX_IMPORT_BYTES = 5 << 20
ROLES = ("user", "assistant")


def chat_json(session: dict, messages: list[dict]) -> str:
    return json.dumps({"format": FORMAT, "title": session["title"], "system_prompt": session["system_prompt"],
                       "exported": time.time(),
                       "messages": [{"role": m["role"], "content": m["content"], "created": m["created"],
                                     "model": m["model"], "token_ids": m["token_ids"],
                                     "author": m.get("author"), "tool_calls": m.get("tool_calls") or [],
                                     "sources": m.get("sources") or []}
                                    for m in messages]},
                      ensure_ascii=False, indent=1)


def chat_markdown(session: dict, messages: list[dict]) -> str:
    lines = [f"# {session['title']}", ""]
    if session["system_prompt"]:
        lines += ["> System prompt: " + session["system_prompt"].replace("\n", " "), ""]
    for m in messages:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(m["created"]))
        lines += [f"**{speaker(m)}** ({when}):", "", m["content"], ""]
        for c in m.get("tool_calls") or []:
            lines += [f"> Tool {c['name']}({c['arguments']}) → {c.get('error') or c.get('result')}", ""]
        if m.get("sources"):
            lines += ["> Sources: " + "; ".join(f"{s['document']}" + (f" › {s['section']}" if s.get("section") else "")
                                               for s in m["sources"]), ""]
    return "\n".join(lines)


def speaker(m: dict) -> str:
    """Who wrote a message, as exports and the review name them."""
    author = m.get("author") or ""
    if author.startswith("agent:"):
        return f"{author.removeprefix('agent:')} (agent)"
    return "Customer" if m["role"] == "user" else "Assistant"


def write_file(name: str, text: str) -> str:
    """A fresh temporary file for Gradio to serve as a download."""
    folder = tempfile.mkdtemp(prefix="pagedchat-export-")
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def safe_name(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", title).strip("-")[:40] or "chat"


def read_chat(path: str) -> dict:
    """A chat JSON file (ours) checked field by field; ValueError says what is wrong."""
    if os.path.getsize(path) > MAX_IMPORT_BYTES:
        raise ValueError(f"the file is over {MAX_IMPORT_BYTES >> 20} MiB")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a JSON file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a pagedchat chat export (expected \"format\": \"{FORMAT}\")")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("the chat has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs a role (user or assistant) and a text content")
        if not isinstance(m.get("created", 0), (int, float)):
            raise ValueError(f"message {i}: created must be a Unix time in seconds")
        ids = m.get("token_ids", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"message {i}: token_ids must be a list of non-negative integers")
    return {"title": str(data.get("title") or "Imported chat")[:80],
            "system_prompt": str(data.get("system_prompt") or ""), "messages": messages}


FEEDBACK_FIELDS = ("feedback_at", "rating", "comment", "user_id", "title", "session_id", "model", "reply",
                   "conversation")


def feedback_rows(rated: list[dict]) -> list[dict]:
    return [{"feedback_at": time.strftime("%Y-%m-%d %H:%M", time.localtime(r["feedback_at"] or 0)),
             "rating": "up" if r["feedback"] == 1 else "down", "comment": r["feedback_comment"] or "",
             "user_id": r["user_id"], "title": r["title"], "session_id": r["session_id"], "model": r["model"],
             "reply": r["reply"], "conversation": r["conversation"]} for r in rated]


def feedback_csv(rows: list[dict]) -> str:
    return csv_text(FEEDBACK_FIELDS,
                    [{**row, "conversation": json.dumps(row["conversation"], ensure_ascii=False)} for row in rows])


FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula


def spreadsheet_safe(value):
    """A text cell a spreadsheet shows as text, never runs (OWASP's CSV injection advice: a quote
    before a formula's first character); numbers stay numbers."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_LEADS) else value


def csv_text(fields: list[str], rows: list[dict]) -> str:
    """A CSV file starting with a byte-order mark, so a spreadsheet opens Hangul (and any non-ASCII
    text) as UTF-8. Customers write some of its cells (comments, messages): none can become a formula."""
    out = io.StringIO(newline="")
    out.write("\ufeff")
    writer = csv.DictWriter(out, fields)
    writer.writeheader()
    writer.writerows({k: spreadsheet_safe(v) for k, v in row.items()} for row in rows)
    return out.getvalue()


def feedback_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
