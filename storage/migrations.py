"""Schema migrations: named functions applied once each, recorded in a ledger table.
Never edit a migration once shipped; add a new one."""
from __future__ import annotations

import time

import sqlite_utils


def m001_initial(db: sqlite_utils.Database) -> None:
    db["users"].create({"id": str, "name": str, "created": float}, pk="id")
    db["sessions"].create({"id": str, "user_id": str, "title": str, "system_prompt": str, "model": str,
                           "created": float, "updated": float}, pk="id",
                          foreign_keys=[("user_id", "users", "id")])
    db["sessions"].create_index(["user_id", "updated"])
    db["messages"].create({"id": int, "session_id": str, "role": str, "content": str, "token_ids": str,
                           "model": str, "finish_reason": str, "prompt_tokens": int, "cached_tokens": int,
                           "generated_tokens": int, "ttft": float, "tokens_per_s": float, "created": float},
                          pk="id", foreign_keys=[("session_id", "sessions", "id")])
    db["messages"].create_index(["session_id", "id"])
    db["settings"].create({"key": str, "value": str}, pk="key")


def m002_feedback_branches_trims(db: sqlite_utils.Database) -> None:
    """Thumbs up/down (+1 / -1) with a comment on replies; `replaced`: when an edit branched the
    conversation away from this message (kept, not shown); `trimmed_turns`: history messages left
    out of this turn's prompt to fit the model's context."""
    for name, kind in (("feedback", int), ("feedback_comment", str), ("feedback_at", float), ("replaced", float),
                       ("trimmed_turns", int)):
        db["messages"].add_column(name, kind)


def m003_assistants(db: sqlite_utils.Database) -> None:
    """Assistants: operator-defined presets, one row per saved version (a chat keeps the version it
    started with); a session names the assistant and version it talks to."""
    db["assistant_versions"].create({"id": int, "assistant": str, "version": int, "name": str, "system_prompt": str,
                                     "greeting": str, "sampling": str, "model": str, "created": float,
                                     "created_by": str}, pk="id")
    db["assistant_versions"].create_index(["assistant", "version"], unique=True)
    db["sessions"].add_column("assistant", str)
    db["sessions"].add_column("assistant_version", int)


def m004_handoff(db: sqlite_utils.Database) -> None:
    """Handoff to a person: a session's state ("assistant", "waiting", "agent"), the agent holding it,
    since when it waits; a message's author where it is not the role's default ("agent:NAME")."""
    db["sessions"].add_column("state", str, not_null_default="assistant")
    db["sessions"].add_column("agent", str)
    db["sessions"].add_column("waiting_since", float)
    db["messages"].add_column("author", str)
    db["sessions"].create_index(["state", "waiting_since"])


def m005_quick_replies_canned(db: sqlite_utils.Database) -> None:
    """Per assistant version: quick-reply chips for customers, canned responses for agents (JSON)."""
    db["assistant_versions"].add_column("quick_replies", str)
    db["assistant_versions"].add_column("canned", str)


def m006_analytics(db: sqlite_utils.Database) -> None:
    """When a chat was first handed to a person (the handoff rate), and messages by time (the
    analytics' day range; bench/analytics.py measures the index)."""
    db["sessions"].add_column("handoff_at", float)
    db["messages"].create_index(["created"])


def m007_tools(db: sqlite_utils.Database) -> None:
    """Tools: an assistant version's (JSON, ui/actions.py checks them); the calls a reply made, with
    their results (JSON); and the shop's orders, which the built-in lookup_order reads."""
    db["assistant_versions"].add_column("tools", str)
    db["messages"].add_column("tool_calls", str)
    db["orders"].create({"order_id": str, "email": str, "status": str, "items": str, "carrier": str,
                         "tracking": str, "placed": str, "delivery": str}, pk="order_id")


def m008_knowledge(db: sqlite_utils.Database) -> None:
    """Knowledge (storage/knowledge.py): an assistant's documents, their chunks, the chunks' FTS5
    index (trigram: Korean and partial words match); per assistant version how many chunks a turn
    takes and the least relevance (JSON); the chunks a reply drew on (JSON)."""
    db["documents"].create({"id": int, "assistant": str, "name": str, "sha256": str, "chars": int,
                            "created": float, "updated": float}, pk="id")
    db["documents"].create_index(["assistant", "name"], unique=True)
    db["chunks"].create({"id": int, "document_id": int, "assistant": str, "ord": int, "section": str, "text": str},
                        pk="id", foreign_keys=[("document_id", "documents", "id")])
    db["chunks"].create_index(["document_id", "ord"])
    db.conn.execute("create virtual table chunks_fts using fts5(text, tokenize='trigram')")
    db["assistant_versions"].add_column("knowledge", str)
    db["messages"].add_column("sources", str)


def m009_presence(db: sqlite_utils.Database) -> None:
    """When each agent or operator last had the console open (storage/handoff.py: who is online)."""
    db["presence"].create({"name": str, "seen": float}, pk="name")


def m010_customer_email(db: sqlite_utils.Database) -> None:
    """A customer the shop signed in (server/customers.py): their e-mail address, which lookup_order trusts."""
    db["users"].add_column("email", str)


def m011_document_source(db: sqlite_utils.Database) -> None:
    """A document fetched from the shop's site: its address, so it can be fetched again."""
    db["documents"].add_column("source", str)


def m012_team_hours(db: sqlite_utils.Database) -> None:
    """Per assistant version: when its team answers chats handed to a person (ui/hours.py's text)."""
    db["assistant_versions"].add_column("hours", str)


MIGRATIONS = [m001_initial, m002_feedback_branches_trims, m003_assistants, m004_handoff, m005_quick_replies_canned,
              m006_analytics, m007_tools, m008_knowledge, m009_presence, m010_customer_email, m011_document_source,
              m012_team_hours]


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the migrations the ledger does not list yet; returns their names."""
    db["_migrations"].create({"name": str, "applied": float}, pk="name", if_not_exists=True)
    done = {row["name"] for row in db["_migrations"].rows}
    applied = []
    for migration in MIGRATIONS:
        if migration.__name__ in done:
            continue
        with db.conn:
            migration(db)
            db["_migrations"].insert({"name": migration.__name__, "applied": time.time()})
        applied.append(migration.__name__)
    return applied
