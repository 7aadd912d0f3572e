"""SQLite storage on a fresh file each test."""
import threading

import pytest
import sqlite_utils

from storage import Store, StoreError
from storage.migrations import MIGRATIONS, migrate


def test_schema_from_a_blank_file_and_migrating_twice_is_a_no_op(tmp_path):
    path = tmp_path / "chat.db"
    Store(str(path))
    db = sqlite_utils.Database(path)
    assert {"users", "sessions", "messages", "settings", "_migrations"} <= set(db.table_names())
    assert [r["name"] for r in db["_migrations"].rows] == [m.__name__ for m in MIGRATIONS]
    assert migrate(db) == []
    assert db.execute("pragma journal_mode").fetchone()[0] == "wal"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # customer chats: owner only


def test_crud_and_per_user_isolation(tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    sid = store.create_session("alice", "Late parcel", "Be kind.", "SmolLM2")
    store.add_message("alice", sid, "user", "Where is my parcel?", [1, 2, 3])
    store.add_message("alice", sid, "assistant", "It is on its way.", [4, 5], finish_reason="stop",
                      prompt_tokens=3, cached_tokens=0, generated_tokens=2, ttft=0.1, tokens_per_s=20.0)
    msgs = store.messages("alice", sid)
    assert [(m["role"], m["token_ids"]) for m in msgs] == [("user", [1, 2, 3]), ("assistant", [4, 5])]
    assert msgs[1]["finish_reason"] == "stop" and msgs[1]["generated_tokens"] == 2
    assert store.messages("bob", sid) == [] and store.session("bob", sid) is None
    with pytest.raises(StoreError):
        store.add_message("bob", sid, "user", "hijack")
    store.update_session("alice", sid, title="Parcel NW1")
    assert [s["title"] for s in store.sessions("alice")] == ["Parcel NW1"]
    assert [s["id"] for s in store.sessions("alice", search="on its way")] == [sid]
    assert store.sessions("alice", search="refund") == []
    assert store.sessions("alice", search="100%") == [] and store.sessions("alice", search="_") == []  # literal
    assert store.sessions("alice", search="x" * 60_000) == []  # past SQLite's LIKE limit: cut, not an error
    store.delete_messages_from("alice", sid, msgs[1]["id"])
    assert len(store.messages("alice", sid)) == 1
    store.delete_session("bob", sid)  # not bob's: nothing happens
    assert store.session("alice", sid)
    store.delete_session("alice", sid)
    assert store.sessions("alice") == [] and store.messages("alice", sid) == []
    assert store.secret() == Store(str(tmp_path / "chat.db")).secret()  # stable across restarts


def test_two_threads_writing_at_once(tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    sids = [store.create_session(f"user{i}") for i in range(2)]
    errors = []

    def write(i):
        try:
            for n in range(100):
                store.add_message(f"user{i}", sids[i], "user", f"message {n}", [n])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [len(store.messages(f"user{i}", sids[i])) for i in range(2)] == [100, 100]


def test_unwritable_path_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        Store(str(tmp_path / "missing" / "chat.db"))
    locked = tmp_path / "ro"
    locked.mkdir()
    (locked / "chat.db").write_bytes(b"this is not a database")
    with pytest.raises(StoreError, match="cannot open database"):
        Store(str(locked / "chat.db"))


def test_app_refuses_to_start_on_an_unwritable_database(tmp_path, capsys):
    import app

    assert app.main(["--db", str(tmp_path / "no" / "such" / "dir" / "chat.db")]) == 2
    assert "cannot open database" in capsys.readouterr().err
