"""Fast tier: `--retention-days`. Chats untouched for that long go with their messages and their
visitors, recent ones stay; deleted text is gone from the database file itself (not left in free
pages or the write-ahead log), for a customer's own delete too; the KV disk tier's old files go."""
import argparse
import logging
import os
import sqlite3
import time

import pytest

import app
from storage import Store
from storage.retention import DAY_S, purge, purge_kv_files, sweep


def file_bytes(path: str) -> bytes:
    data = b""
    for name in (path, path + "-wal"):
        if os.path.exists(name):
            data += open(name, "rb").read()
    return data


def chat(store: Store, user: str, text: str, age_days: float) -> str:
    sid = store.create_session(user)
    store.add_message(user, sid, "user", text, [1, 2, 3])
    store.add_message(user, sid, "assistant", f"reply to {text}", [4, 5])
    when = time.time() - age_days * DAY_S
    with store._db() as db:
        db.execute("update sessions set updated = ?, created = ? where id = ?", [when, when, sid])
        db.execute("update users set created = ? where id = ?", [when, user])
    return sid


@pytest.fixture
def busy(tmp_path):
    """The database path, with another connection open on it throughout, as a serving process has:
    the write-ahead log then outlives each operation (SQLite removes it when the last one closes)."""
    path = str(tmp_path / "chat.db")
    Store(path)
    other = sqlite3.connect(path)
    other.execute("select count(*) from sessions").fetchall()
    yield path
    other.close()


def test_chats_untouched_for_the_period_go_and_their_text_leaves_the_file(busy):
    path = busy
    store = Store(path)
    old = chat(store, "visitor-old", "OLDSECRET my address is 12 Elm Street", 40)
    kept = chat(store, "visitor-new", "RECENT where is my order", 2)
    mixed_old = chat(store, "alice", "ALICEOLD an old question", 31)
    mixed_new = chat(store, "alice", "ALICENEW a new question", 29)
    with store._db() as db:  # on by default in most builds of SQLite, not all
        assert db.execute("pragma secure_delete").fetchone()[0] == 1
    assert b"OLDSECRET" in file_bytes(path)
    assert purge(store, 30) == {"chats": 2, "messages": 4, "visitors": 1}
    assert store.session("visitor-old", old) is None and store.messages("visitor-old", old) == []
    assert store.session("alice", mixed_old) is None
    assert [m["content"] for m in store.messages("visitor-new", kept)] == ["RECENT where is my order",
                                                                            "reply to RECENT where is my order"]
    assert store.session("alice", mixed_new) is not None  # alice keeps her recent chat, so her user row too
    with store._db() as db:
        assert {r[0] for r in db.execute("select id from users")} == {"visitor-new", "alice"}
    data = file_bytes(path)
    assert b"OLDSECRET" not in data and b"ALICEOLD" not in data and b"RECENT" in data


def test_a_customers_own_delete_leaves_no_text_in_the_file(busy):
    path = busy
    store = Store(path)
    sid = chat(store, "bo", "CARDHOLDER Bo Lee of 5 Pine Road", 0)
    others = chat(store, "bo", "KEEPME", 0)
    store.delete_session("bo", sid)
    assert b"CARDHOLDER" not in file_bytes(path) and b"KEEPME" in file_bytes(path)
    store.delete_all_sessions("bo")
    assert b"KEEPME" not in file_bytes(path) and store.session("bo", others) is None


def test_old_kv_disk_files_go_and_others_stay(tmp_path):
    folder = tmp_path / "kv" / "model-id"
    folder.mkdir(parents=True)
    now = time.time()
    for name, age in (("aa.kv", 40), ("bb.kv", 10), ("cc.tmp", 40), ("notes.txt", 40)):
        (folder / name).write_bytes(b"x")
        os.utime(folder / name, (now - age * DAY_S, now - age * DAY_S))
    assert purge_kv_files(str(tmp_path / "kv"), 30) == 1
    assert sorted(os.listdir(folder)) == ["bb.kv", "cc.tmp", "notes.txt"]


def test_a_sweep_on_a_database_that_cannot_be_used_waits_for_the_next(tmp_path, caplog):
    path = str(tmp_path / "chat.db")
    store = Store(path)
    chat(store, "cy", "old", 40)
    os.rename(path, path + ".moved")  # the file is gone from under the server
    with caplog.at_level(logging.WARNING, "pagedchat.retention"):
        sweep(store, 30, None)
    assert "could not run" in caplog.text


@pytest.mark.parametrize("value", ["0", "-3", "x", "nan", "inf"])
def test_the_flag_takes_a_positive_number_of_days(value):
    with pytest.raises(argparse.ArgumentTypeError, match="not a number of days above 0"):
        app.positive_days(value)
    assert app.positive_days("0.5") == 0.5 and app.parse_args(["--retention-days", "30"]).retention_days == 30
