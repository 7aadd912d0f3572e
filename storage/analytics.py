"""Operators' analytics from SQLite, per day and per assistant: chats, turns, handoff rate,
thumbs-up rate, TTFT median and p95, tokens generated, the prefix cache's share of prompt tokens;
and what customers asked about that no document mentions (the knowledge base's gaps).
Two grouped queries over the day range, percentiles in Python. Messages are indexed by time, which
pays for short ranges only: on 100k messages over 90 days (bench/analytics.py, an AMD EPYC,
2026-12-03) the 7-day table took 47 ms with it and 58 without, while the 30-day one through the index
took 218 ms against 181 scanning (90 days: 666 against 485), so ranges from INDEX_DAYS on scan
(`+m.created` keeps SQLite off the index): 30 days 157-163 ms, 90 days 348-405 ms."""
from __future__ import annotations

import re
import statistics
import time

from storage.knowledge import STOPWORDS, Knowledge

INDEX_DAYS = 14
COLUMNS = ["day", "assistant", "chats", "turns", "handoff rate", "thumbs-up rate", "TTFT p50 (ms)", "TTFT p95 (ms)",
           "tokens generated", "cached share of prompt tokens"]


MAX_DAYS = 366


def day_range(days) -> int:
    """The days an operator asked for (a number field, a query value), as daily() takes them: 1 to MAX_DAYS."""
    return max(1, min(int(30 if days is None else days), MAX_DAYS))


def daily(store, days: int = 30, now: float | None = None) -> list[dict]:
    """One row per (day, assistant) with activity in the last `days` days, newest day first."""
    since = (now or time.time()) - days * 86400
    created = "m.created" if days < INDEX_DAYS else "+m.created"
    with store._db() as db:
        groups = {(r["day"], r["assistant"]): dict(r) for r in db.query(
            "select date(m.created, 'unixepoch', 'localtime') as day, coalesce(s.assistant, '') as assistant, "
            "count(distinct m.session_id) as chats, sum(m.role = 'user') as turns, "
            "sum(m.feedback = 1) as up, sum(m.feedback is not null) as rated, "
            "sum(coalesce(m.generated_tokens, 0)) as generated, sum(coalesce(m.prompt_tokens, 0)) as prompt, "
            "sum(coalesce(m.cached_tokens, 0)) as cached, "
            "count(distinct case when s.handoff_at is not null and date(s.handoff_at, 'unixepoch', 'localtime') = "
            "date(m.created, 'unixepoch', 'localtime') then s.id end) as handoffs "
            f"from messages m join sessions s on s.id = m.session_id where {created} >= ? and m.replaced is null "
            "group by day, assistant", [since])}
        ttfts: dict[tuple, list[float]] = {}
        for r in db.query("select date(m.created, 'unixepoch', 'localtime') as day, coalesce(s.assistant, '') as a, "
                          f"m.ttft from messages m join sessions s on s.id = m.session_id where {created} >= ? and "
                          "m.role = 'assistant' and m.ttft is not null", [since]):
            ttfts.setdefault((r["day"], r["a"]), []).append(r["ttft"])
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1]), reverse=True):
        g, times = groups[key], sorted(ttfts.get(key, []))
        p95 = times[min(len(times) - 1, int(0.95 * len(times)))] if times else None
        rows.append({"day": g["day"], "assistant": g["assistant"], "chats": g["chats"], "turns": g["turns"],
                     "handoff rate": round(g["handoffs"] / g["chats"], 3) if g["chats"] else 0.0,
                     "thumbs-up rate": round(g["up"] / g["rated"], 3) if g["rated"] else None,
                     "TTFT p50 (ms)": round(1000 * statistics.median(times)) if times else None,
                     "TTFT p95 (ms)": round(1000 * p95) if times else None,
                     "tokens generated": g["generated"],
                     "cached share of prompt tokens": round(g["cached"] / g["prompt"], 3) if g["prompt"] else None})
    return rows


GAP_COLUMNS = ["question", "words no document has", "times asked", "last asked", "assistant"]
# Besides the search's stopwords: words of small talk, so "hi there" or "thanks a lot" is no question.
SMALL_TALK = frozenset("hi hey bye lot okay great cool nice good morning evening afternoon sorry sure".split())
SCANNED = 2000  # the customer messages unanswered() reads, newest first


def unanswered(store, days: int = 30, now: float | None = None, limit: int = 50) -> list[dict]:
    """What customers asked about that the documents never mention, for assistants that have
    documents: the knowledge base's gaps, each question with its words that no document holds (as
    the search finds words), most asked first. Read now, so a document added since closes its gaps
    at once. Counted are the last SCANNED customer messages of the range that the model answered
    without a tool (an order lookup is no gap; a person's answer is not the model's); the same words
    (case, spacing and end punctuation aside) count once with how often they were asked; small talk
    is left out."""
    since = (now or time.time()) - days * 86400
    created = "u.created" if days < INDEX_DAYS else "+u.created"
    with store._db() as db:
        rows = list(db.query(
            "select u.content, u.created, s.assistant from messages u join sessions s on s.id = u.session_id "
            "join messages r on r.id = (select min(n.id) from messages n where n.session_id = u.session_id and "
            "n.id > u.id and n.role = 'assistant' and n.replaced is null) "
            f"where u.role = 'user' and u.replaced is null and {created} >= ? and r.author is null and "
            "coalesce(r.tool_calls, '[]') = '[]' and s.assistant in (select assistant from documents) "
            "order by u.id desc limit ?", [since, SCANNED]))
    knowledge, known = Knowledge(store), {}
    gaps: dict[tuple[str, str], dict] = {}
    for r in rows:  # newest first
        words = dict.fromkeys(w for w in re.findall(r"\w+", r["content"].lower())
                              if (len(w) >= 3 or not w.isascii()) and w not in STOPWORDS and w not in SMALL_TALK)
        for w in words:
            if (r["assistant"], w) not in known:
                known[r["assistant"], w] = bool(knowledge.search(r["assistant"], w, 1))  # it, or its stem
        missing = [w for w in words if not known[r["assistant"], w]]
        if missing:
            key = (r["assistant"], " ".join(r["content"].lower().split()).rstrip("?!.。 "))
            gap = gaps.setdefault(key, {"question": r["content"].strip(), "words no document has": ", ".join(missing),
                                        "times asked": 0, "assistant": r["assistant"],
                                        "last asked": time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))})
            gap["times asked"] += 1
    return sorted(gaps.values(), key=lambda g: -g["times asked"])[:limit]
