"""Handoff to a person, in SQLite so it survives a restart: a chat is "assistant" (the model
answers), "waiting" (for a person; the model does not answer) or "agent" (a person holds it and
answers). Customers ask; agents and operators take, reply and hand back. Every change is one
guarded UPDATE, so two agents cannot both take a chat. Who of the team is online is known by their
console, which says so while it is open (`seen`)."""
from __future__ import annotations

import json
import time
from typing import Callable

from storage.store import like_pattern

STATES = ("assistant", "waiting", "agent")
ONLINE_S = 120.0  # a console seen this recently is open (a background tab's timers tick about once a minute)


LISTED = ("s.id, s.user_id, s.title, s.assistant, s.state, s.agent, s.waiting_since, s.updated, "
          "(select u.name from users u where u.id = s.user_id) as name, "
          "(select u.email from users u where u.id = s.user_id) as email")


class Handoff:
    def __init__(self, store, on_waiting: Callable[[str], None] | None = None) -> None:
        """on_waiting(session_id): called when a chat begins to wait (ui/notify.py tells the team)."""
        self.store, self.on_waiting = store, on_waiting

    def ask(self, session_id: str) -> bool:
        """The customer asks for a person; False if the chat already waits or is with one."""
        with self.store._db() as db:
            now = time.time()
            asked = db.conn.execute("update sessions set state = 'waiting', waiting_since = ?, agent = null, "
                                    "handoff_at = coalesce(handoff_at, ?) where id = ? and state = 'assistant'",
                                    [now, now, session_id]).rowcount == 1
        if asked and self.on_waiting is not None:
            self.on_waiting(session_id)
        return asked

    def cancel(self, session_id: str) -> bool:
        """The customer goes back to the assistant before a person took the chat; False if it did not wait."""
        with self.store._db() as db:
            return db.conn.execute("update sessions set state = 'assistant', waiting_since = null where id = ? and "
                                   "state = 'waiting'", [session_id]).rowcount == 1

    def seen(self, name: str) -> None:
        """An agent's or operator's console is open now."""
        with self.store._db() as db:
            db.conn.execute("insert into presence(name, seen) values (?, ?) on conflict(name) do update set "
                            "seen = excluded.seen", [name, time.time()])

    def online(self) -> list[str]:
        """The agents and operators whose console is open, by name."""
        with self.store._db() as db:
            return [r[0] for r in db.execute("select name from presence where seen > ? order by name",
                                             [time.time() - ONLINE_S])]

    def take(self, session_id: str, agent: str) -> str | None:
        """The agent takes the chat (waiting, or with the assistant: an operator's takeover). None if
        it is now theirs, else who holds it."""
        with self.store._db() as db:
            taken = db.conn.execute("update sessions set state = 'agent', agent = ? where id = ? and "
                                    "(state != 'agent' or agent = ?)", [agent, session_id, agent]).rowcount
            if taken:
                return None
            row = db.execute("select agent from sessions where id = ?", [session_id]).fetchone()
        if row is None:
            raise ValueError(f"there is no chat {session_id}")
        return row[0]

    def hand_back(self, session_id: str, agent: str) -> bool:
        """The holder gives the chat back to the assistant; False if they do not hold it."""
        with self.store._db() as db:
            return db.conn.execute("update sessions set state = 'assistant', agent = null, waiting_since = null "
                                   "where id = ? and state = 'agent' and agent = ?", [session_id, agent]).rowcount == 1

    def reply(self, session_id: str, agent: str, text: str) -> int:
        """The holder's reply, stored as the chat's next assistant message, authored by them."""
        with self.store._db() as db:
            row = db.execute("select state, agent from sessions where id = ?", [session_id]).fetchone()
            if row is None:
                raise ValueError(f"there is no chat {session_id}")
            if row[0] != "agent" or row[1] != agent:
                holder = f"{row[1]} has it" if row[0] == "agent" else "take it first"
                raise ValueError(f"this chat is not yours to answer ({holder})")
            now = time.time()
            message_id = db["messages"].insert({"session_id": session_id, "role": "assistant", "content": text,
                                                "token_ids": json.dumps([]), "created": now,
                                                "author": f"agent:{agent}", "model": ""}).last_pk
            db.conn.execute("update sessions set updated = ? where id = ?", [now, session_id])
        return message_id

    def state(self, session_id: str) -> dict:
        """{state, agent, place}: place is 1 for the first chat in line (None unless waiting)."""
        with self.store._db() as db:
            row = db.execute("select state, agent, waiting_since from sessions where id = ?", [session_id]).fetchone()
            if row is None:
                return {"state": "assistant", "agent": None, "place": None}
            place = None
            if row[0] == "waiting":
                place = 1 + db.execute("select count(*) from sessions where state = 'waiting' and waiting_since < ?",
                                       [row[2]]).fetchone()[0]
        return {"state": row[0], "agent": row[1], "place": place}

    def inbox(self, recent_seconds: float = 3600) -> list[dict]:
        """Chats waiting (oldest first), then those with a person, then those the assistant answered
        in the last `recent_seconds` (an operator may take one over; a chat only opened, with no
        message yet, is not listed)."""
        with self.store._db() as db:
            return list(db.query(
                f"select {LISTED}, (select content from messages m where m.session_id = s.id and m.replaced is null "
                " order by m.id desc limit 1) as last from sessions s where s.state != 'assistant' "
                "or (s.updated > ? and exists (select 1 from messages m where m.session_id = s.id)) "
                "order by case s.state when 'waiting' then 0 when 'agent' then 1 else 2 end, "
                "coalesce(s.waiting_since, 0), s.updated desc limit 200", [time.time() - recent_seconds]))

    def waiting(self) -> int:
        with self.store._db() as db:
            return db.execute("select count(*) from sessions where state = 'waiting'").fetchone()[0]

    def find(self, words: str, limit: int = 50) -> list[dict]:
        """Any chat, newest first, whose id is `words` or whose title, customer or a message holds them
        (literally: `100%` is no wildcard); `last` is its newest message that holds them."""
        words = words.strip()
        like = like_pattern(words)
        holds = "m.session_id = s.id and m.replaced is null and m.content like ? escape '\\'"
        with self.store._db() as db:
            return list(db.query(
                f"select {LISTED}, coalesce((select content from messages m where {holds} order by m.id desc limit 1), "
                "(select content from messages m where m.session_id = s.id order by m.id desc limit 1)) as last "
                f"from sessions s where s.id = ? or s.title like ? escape '\\' or s.user_id like ? escape '\\' "
                "or s.user_id in (select id from users where email like ? escape '\\' or name like ? escape '\\') "
                f"or exists (select 1 from messages m where {holds}) order by s.updated desc limit ?",
                [like, words, like, like, like, like, like, limit]))

    def assistant_of(self, session_id: str) -> str | None:
        with self.store._db() as db:
            row = db.execute("select assistant from sessions where id = ?", [session_id]).fetchone()
        return row[0] if row else None

    def conversation(self, session_id: str) -> list[dict]:
        """The chat's messages for the agent (whoever the customer is)."""
        with self.store._db() as db:
            return list(db["messages"].rows_where("session_id = ? and replaced is null", [session_id],
                                                  order_by="id", select="id, role, content, author, created"))
