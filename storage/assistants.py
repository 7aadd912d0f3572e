"""Assistants in the store: operators define them (ui/assistants.py checks the values), and every save is
a new version, so a chat keeps the version it started with. Mixed into storage.store.Store, whose `_db()`
it uses."""
from __future__ import annotations

import json
import time


class AssistantVersions:
    def save_assistant(self, slug: str, fields: dict, by: str) -> int:
        """A new version of assistant `slug` (its first if new); returns the version number."""
        row = {k: fields[k] for k in ("name", "system_prompt", "greeting", "model")}
        row["hours"] = fields.get("hours") or ""
        row.update({k: json.dumps(fields.get(k) or ([] if k in ("quick_replies", "tools") else {}), ensure_ascii=False)
                    for k in ("sampling", "quick_replies", "canned", "tools", "knowledge")})
        with self._db() as db:
            latest = db.execute("select max(version) from assistant_versions where assistant = ?", [slug]).fetchone()[0]
            version = (latest or 0) + 1
            db["assistant_versions"].insert({"assistant": slug, "version": version, "created": time.time(),
                                             "created_by": by, **row})
        return version

    def assistant(self, slug: str, version: int | None = None) -> dict | None:
        """One version of an assistant (the latest by default), or None."""
        with self._db() as db:
            rows = list(db.query("select * from assistant_versions where assistant = ? and (? is null or version = ?) "
                                 "order by version desc limit 1", [slug, version, version]))
        return _assistant_row(rows[0]) if rows else None

    def assistant_versions(self) -> list[dict]:
        """Every saved version of every assistant (no prompts), by assistant, newest version first."""
        with self._db() as db:
            return list(db.query("select assistant, version, name, created, created_by from assistant_versions "
                                 "order by assistant, version desc"))

    def assistants(self) -> list[dict]:
        """The latest version of every assistant, by name."""
        with self._db() as db:
            rows = list(db.query("select * from assistant_versions v where version = (select max(version) from "
                                 "assistant_versions where assistant = v.assistant) order by name"))
        return [_assistant_row(r) for r in rows]


def _assistant_row(row: dict) -> dict:
    row["sampling"] = json.loads(row["sampling"] or "{}")
    row["quick_replies"] = json.loads(row.get("quick_replies") or "[]")
    row["canned"] = json.loads(row.get("canned") or "{}")
    row["tools"] = json.loads(row.get("tools") or "[]")
    row["knowledge"] = json.loads(row.get("knowledge") or "{}")
    row["hours"] = row.get("hours") or ""
    return row
