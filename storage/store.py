"""Users, chat sessions and messages (with their exact token ids) in SQLite through sqlite-utils.

A new connection per operation: safe from any thread (Gradio handlers, the engine's callbacks),
WAL so readers never block the writer, foreign keys on so a deleted session takes its messages.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import time
import uuid
from urllib.request import pathname2url

import sqlite_utils

from storage.assistants import AssistantVersions
from storage.migrations import migrate


_STATS = ("model", "finish_reason", "prompt_tokens", "cached_tokens", "generated_tokens", "ttft", "tokens_per_s",
          "trimmed_turns")


class StoreError(RuntimeError):
    """The database cannot be opened or written."""


class StoreUnavailable(StoreError):
    """The database is there but cannot serve now: locked by another process past the busy timeout,
    read-only, full, or its file deleted or replaced while running. Worth trying again later (or,
    for a deleted file, after a restart); nothing was written."""


MAX_SEARCH_CHARS = 200  # a chat search's words (SQLite refuses LIKE patterns past 50 000 bytes)
BUSY_TIMEOUT_S = 10  # how long an operation waits for another process's lock before StoreUnavailable


class Store(AssistantVersions):
    def __init__(self, path: str) -> None:
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise StoreError(f"cannot open database {path}: folder {folder} does not exist")
        try:  # customer chats: a new file is readable by its owner only (SQLite gives -wal/-shm the same)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        except OSError as e:
            raise StoreError(f"cannot open database {path}: {e}") from None
        self.problem: str | None = None  # why the last operation failed, until one succeeds (for /health)
        self._identity = self._file_identity()
        self._uri = f"file:{pathname2url(os.path.abspath(path))}?mode=rw"  # never creates a file
        try:
            with self._db() as db:
                db.conn.execute("PRAGMA journal_mode=WAL")
                migrate(db)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open database {path}: {e}") from None

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    @contextlib.contextmanager
    def _db(self):
        """One connection for one operation. The file must be the one opened at start: a deleted
        or replaced file is refused (SQLite would silently make a new, empty one)."""
        if self._file_identity() != self._identity:
            self.problem = self._moved()
            raise StoreUnavailable(self.problem)
        try:
            conn = sqlite3.connect(self._uri, uri=True, timeout=BUSY_TIMEOUT_S)
            try:
                conn.execute("PRAGMA foreign_keys=ON")
                conn.execute("PRAGMA secure_delete=ON")  # a deleted chat's text is overwritten, not left in free pages
                yield sqlite_utils.Database(conn)
                conn.commit()
            finally:
                conn.close()
        except sqlite3.OperationalError as e:
            self.problem = f"the database cannot be used right now ({e})"
            raise StoreUnavailable(self.problem) from None
        self.problem = None

    def health(self) -> str | None:
        """None while the database serves; else why it does not (the last failure, or a deleted file)."""
        return self._moved() if self._file_identity() != self._identity else self.problem

    def _moved(self) -> str:
        return (f"the database file {self.path} was deleted or replaced while the server ran; chats are not "
                f"saved until it is restored and the server restarted")

    # ---- settings -----------------------------------------------------------------------
    def secret(self) -> str:
        """A per-installation secret, made once: browser ids stay valid across restarts."""
        with self._db() as db:
            rows = list(db["settings"].rows_where("key = ?", ["browser_secret"]))
            if rows:
                return rows[0]["value"]
            value = secrets.token_hex(32)
            db["settings"].insert({"key": "browser_secret", "value": value}, ignore=True)
            return list(db["settings"].rows_where("key = ?", ["browser_secret"]))[0]["value"]

    # ---- users and sessions ---------------------------------------------------------------
    def ensure_user(self, user_id: str, name: str | None = None, email: str | None = None) -> None:
        """The user's row; a signed-in customer's name and e-mail address (server/customers.py) as
        their shop last said."""
        with self._db() as db:
            db["users"].insert({"id": user_id, "name": name or user_id, "created": time.time()}, ignore=True)
            if email is not None:
                db.execute("update users set name = ?, email = ? where id = ?", [name or user_id, email, user_id])

    def user_email(self, user_id: str) -> str:
        with self._db() as db:
            row = db.execute("select email from users where id = ?", [user_id]).fetchone()
        return (row[0] or "") if row else ""

    def create_session(self, user_id: str, title: str = "New chat", system_prompt: str = "",
                       model: str = "", assistant: str | None = None, assistant_version: int | None = None) -> str:
        self.ensure_user(user_id)
        sid = uuid.uuid4().hex[:12]
        now = time.time()
        with self._db() as db:
            db["sessions"].insert({"id": sid, "user_id": user_id, "title": title, "system_prompt": system_prompt,
                                   "model": model, "created": now, "updated": now, "assistant": assistant,
                                   "assistant_version": assistant_version})
        return sid

    def sessions(self, user_id: str, search: str = "", assistant: str | None = None) -> list[dict]:
        """The user's sessions, most recently updated first; `search` matches titles and messages;
        `assistant`: only the chats with that assistant."""
        where, args = "user_id = ?", [user_id]
        if assistant is not None:
            where, args = where + " and assistant = ?", args + [assistant]
        with self._db() as db:
            if not search:
                return list(db["sessions"].rows_where(where, args, order_by="updated desc"))
            like = like_pattern(search)
            return list(db.query(
                f"select * from sessions where {where} and (title like ? escape '\\' or id in "
                "(select session_id from messages where content like ? escape '\\')) order by updated desc",
                [*args, like, like]))

    def session(self, user_id: str, session_id: str) -> dict | None:
        """A session, only if it belongs to this user."""
        with self._db() as db:
            rows = list(db["sessions"].rows_where("id = ? and user_id = ?", [session_id, user_id]))
        return rows[0] if rows else None

    def update_session(self, user_id: str, session_id: str, **fields) -> None:
        allowed = {k: v for k, v in fields.items() if k in ("title", "system_prompt", "model")}
        allowed["updated"] = time.time()
        with self._db() as db:
            db.conn.execute(f"update sessions set {', '.join(f'{k} = ?' for k in allowed)} "
                            "where id = ? and user_id = ?", [*allowed.values(), session_id, user_id])

    def delete_session(self, user_id: str, session_id: str) -> None:
        with self._db() as db:
            if self._owned(db, user_id, session_id):
                db.conn.execute("delete from messages where session_id = ?", [session_id])
                db.conn.execute("delete from sessions where id = ?", [session_id])
        self.checkpoint()

    def checkpoint(self) -> None:
        """Move the write-ahead log into the file and truncate it: after a delete, the deleted text is
        not left in the log's old frames."""
        with self._db() as db:
            db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ---- messages -----------------------------------------------------------------------
    def add_message(self, user_id: str, session_id: str, role: str, content: str,
                    token_ids: list[int] | None = None, **stats) -> int:
        row = {"session_id": session_id, "role": role, "content": content,
               "token_ids": json.dumps(token_ids or []), "created": time.time()}
        row.update({k: v for k, v in stats.items() if k in (*_STATS, "created", "author")})
        row.update(_json_fields(stats))
        with self._db() as db:
            if not self._owned(db, user_id, session_id):
                raise StoreError(f"session {session_id} does not belong to this user")
            message_id = db["messages"].insert(row).last_pk
            db.conn.execute("update sessions set updated = ? where id = ?", [time.time(), session_id])
        return message_id

    def update_message(self, user_id: str, session_id: str, message_id: int, content: str,
                       token_ids: list[int], **stats) -> None:
        """Rewrite a message as it grows (a streaming reply); StoreError if the session is gone."""
        row = {"content": content, "token_ids": json.dumps(token_ids)}
        row.update({k: v for k, v in stats.items() if k in _STATS})
        row.update(_json_fields(stats))
        with self._db() as db:
            if not self._owned(db, user_id, session_id):
                raise StoreError(f"session {session_id} does not exist or does not belong to this user")
            db.conn.execute(f"update messages set {', '.join(f'{k} = ?' for k in row)} where id = ? and session_id = ?",
                            [*row.values(), message_id, session_id])

    def mark_interrupted(self) -> int:
        """At start: replies still marked "streaming" were cut by the process ending."""
        with self._db() as db:
            return db.conn.execute("update messages set finish_reason = 'interrupted' "
                                   "where finish_reason = 'streaming'").rowcount

    def messages(self, user_id: str, session_id: str) -> list[dict]:
        """The conversation as it stands (messages an edit branched away from are left out)."""
        with self._db() as db:
            if not self._owned(db, user_id, session_id):
                return []
            rows = list(db["messages"].rows_where("session_id = ? and replaced is null", [session_id], order_by="id"))
        for row in rows:
            row["token_ids"] = json.loads(row["token_ids"] or "[]")
            row["tool_calls"] = json.loads(row.get("tool_calls") or "[]")
            row["sources"] = json.loads(row.get("sources") or "[]")
        return rows

    def delete_messages_from(self, user_id: str, session_id: str, message_id: int) -> None:
        """Drop a message and everything after it (regenerate, edit)."""
        with self._db() as db:
            if self._owned(db, user_id, session_id):
                db.conn.execute("delete from messages where session_id = ? and id >= ?", [session_id, message_id])

    def branch_from(self, user_id: str, session_id: str, message_id: int) -> None:
        """Set a message and everything after it aside (edit and resend): kept in the database, no
        longer part of the conversation."""
        with self._db() as db:
            if self._owned(db, user_id, session_id):
                db.conn.execute("update messages set replaced = ? where session_id = ? and id >= ? and replaced is null",
                                [time.time(), session_id, message_id])

    def set_feedback(self, user_id: str, session_id: str, message_id: int, value: int | None,
                     comment: str | None = None) -> None:
        """+1 / -1 / None (cleared) on one of the user's replies; a comment replaces the last one."""
        with self._db() as db:
            if not self._owned(db, user_id, session_id):
                raise StoreError(f"session {session_id} does not belong to this user")
            db.conn.execute("update messages set feedback = ?, feedback_comment = coalesce(?, feedback_comment), "
                            "feedback_at = ? where id = ? and session_id = ? and role = 'assistant'",
                            [value, comment, time.time(), message_id, session_id])

    def rated_replies(self) -> list[dict]:
        """Every rated reply with its conversation (operators only: the caller checks), newest first."""
        with self._db() as db:
            rows = list(db.query(
                "select m.id, m.session_id, s.user_id, s.title, m.feedback, m.feedback_comment, m.feedback_at, "
                "m.content as reply, m.model from messages m join sessions s on s.id = m.session_id "
                "where m.feedback is not null order by m.feedback_at desc"))
            for row in rows:
                row["conversation"] = [_review_message(r) for r in db.query(
                    "select role, content, author, tool_calls, sources from messages where session_id = ? "
                    "and id <= ? and replaced is null order by id", [row["session_id"], row["id"]])]
        return rows

    def import_session(self, user_id: str, title: str, system_prompt: str, messages: list[dict],
                       assistant: str | None = None, assistant_version: int | None = None) -> str:
        """A new session holding `messages` (role, content, and optionally created, model, token_ids)."""
        sid = self.create_session(user_id, title, system_prompt, messages[-1].get("model") or "", assistant,
                                  assistant_version)
        for m in messages:
            self.add_message(user_id, sid, m["role"], m["content"], m.get("token_ids") or [],
                             model=m.get("model") or "", created=m.get("created") or time.time())
        return sid

    def delete_all_sessions(self, user_id: str) -> int:
        with self._db() as db:
            ids = [r["id"] for r in db["sessions"].rows_where("user_id = ?", [user_id], select="id")]
            for sid in ids:
                db.conn.execute("delete from messages where session_id = ?", [sid])
            db.conn.execute("delete from sessions where user_id = ?", [user_id])
        self.checkpoint()
        return len(ids)

    @staticmethod
    def _owned(db, user_id: str, session_id: str) -> bool:
        return bool(list(db["sessions"].rows_where("id = ? and user_id = ?", [session_id, user_id])))


def like_pattern(words: str) -> str:
    """A LIKE pattern (with `escape '\\'`) that finds what was typed, literally: "100%" is no wildcard."""
    escaped = words[:MAX_SEARCH_CHARS].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _review_message(r: dict) -> dict:
    """A message as the rated-reply review shows it: who wrote it, and the tools and sources it used."""
    out = {"role": r["role"], "content": r["content"]}
    if r["author"]:
        out["author"] = r["author"]
    out.update({k: json.loads(r[k]) for k in ("tool_calls", "sources") if r[k]})
    return out


def _json_fields(stats: dict) -> dict:
    """A reply's tool calls and knowledge sources, as the columns store them."""
    return {k: json.dumps(stats[k], ensure_ascii=False) for k in ("tool_calls", "sources") if stats.get(k)}

