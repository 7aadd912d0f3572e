"""How long customers' chats are kept, and a customer's right to see or erase theirs.

`--retention-days N`: a chat nobody has written to for N
days is deleted with its messages (their text, token ids, tool results, sources and feedback), and
so is a visitor left without chats. A sweep runs at start and every hour. Deleted rows are
overwritten in the file (SQLite's secure_delete, on for every connection, so a chat a customer
deletes goes the same way) and the write-ahead log is truncated after a sweep, so the text does not
linger there either. The KV disk tier's files (`--kv-disk`, which hold the token ids of the blocks
they cache) older than N days are deleted too; the engine treats a missing file as a miss, as it does
when another process sharing the folder deletes one. Analytics lose the days they were computed
from: what is kept is what is counted."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from storage.background import repeat
from storage.store import Store, StoreError

DAY_S = 86400
SWEEP_S = 3600
log = logging.getLogger("pagedchat.retention")


def purge(store: Store, days: float, now: float | None = None) -> dict[str, int]:
    """Delete the chats untouched for `days`; how many chats, messages and visitors went."""
    cutoff = (time.time() if now is None else now) - days * DAY_S
    with store._db() as db:
        old = "select id from sessions where updated < ?"
        messages = db.execute(f"delete from messages where session_id in ({old})", [cutoff]).rowcount
        sessions = db.execute("delete from sessions where updated < ?", [cutoff]).rowcount
        users = db.execute("delete from users where created < ? and id not in (select user_id from sessions)",
                           [cutoff]).rowcount
    store.checkpoint()
    return {"chats": sessions, "messages": messages, "visitors": users}


def resolve(store: Store, who: str) -> str | None:
    """The user id an operator means: one as the inbox shows it (`visitor:...`, `login:...`,
    `customer:...`), or a signed-in customer's e-mail address."""
    who = (who or "").strip()
    with store._db() as db:
        row = db.execute("select id from users where id = ? or (email != '' and email = lower(?)) order by id = ? desc",
                         [who, who, who]).fetchone()
    return row[0] if row else None


def customer_data(store: Store, user_id: str) -> dict:
    """Everything stored of one customer, for their access request."""
    with store._db() as db:
        user = db.execute("select id, name, email, created from users where id = ?", [user_id]).fetchone()
        sessions = [dict(zip(("id", "title", "assistant", "created", "updated", "state"), r)) for r in db.execute(
            "select id, title, assistant, created, updated, state from sessions where user_id = ? order by created",
            [user_id])]
        fields = ("role", "author", "content", "created", "model", "finish_reason", "tool_calls", "sources",
                  "feedback", "feedback_comment")
        for session in sessions:
            session["messages"] = [_parsed(dict(zip(fields, r))) for r in db.execute(
                f"select {', '.join(fields)} from messages where session_id = ? order by id", [session["id"]])]
    return {"user": dict(zip(("id", "name", "email", "created"), user)) if user else {"id": user_id},
            "chats": sessions}


def _parsed(message: dict) -> dict:
    for key in ("tool_calls", "sources"):  # stored as JSON text
        if isinstance(message[key], str):
            message[key] = json.loads(message[key])
    return message


def forget(store: Store, user_id: str) -> dict[str, int]:
    """Erase one customer: their chats, messages and user row, overwritten in the file."""
    with store._db() as db:
        mine = "select id from sessions where user_id = ?"
        messages = db.execute(f"delete from messages where session_id in ({mine})", [user_id]).rowcount
        chats = db.execute("delete from sessions where user_id = ?", [user_id]).rowcount
        db.execute("delete from users where id = ?", [user_id])
    store.checkpoint()
    return {"chats": chats, "messages": messages}


def purge_kv_files(folder: str, days: float, now: float | None = None) -> int:
    """Delete the KV disk tier's block files last written more than `days` ago; how many."""
    cutoff, gone = (time.time() if now is None else now) - days * DAY_S, 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                if name.endswith(".kv") and os.stat(path).st_mtime < cutoff:
                    os.unlink(path)
                    gone += 1
            except OSError:  # gone already (another process's sweep or its size bound)
                continue
    return gone


def sweep(store: Store, days: float, kv_folder: str | None) -> None:
    try:
        counts = purge(store, days)
        if kv_folder:
            counts["KV disk files"] = purge_kv_files(kv_folder, days)
    except StoreError as e:  # the database cannot be used now: the next sweep tries again
        log.warning("retention: the sweep could not run: %s", e)
        return
    if any(counts.values()):
        log.info("retention: deleted what was older than %g days: %s", days,
                 ", ".join(f"{what}: {n}" for what, n in counts.items()))


def start_sweeps(store: Store, days: float, kv_folder: str | None = None) -> threading.Thread:
    """A daemon thread that sweeps now and every SWEEP_S seconds."""
    return repeat("retention", SWEEP_S, lambda: sweep(store, days, kv_folder))
