"""When the chat's database misbehaves: locked by another process, or its file deleted while the
server runs. The chat refuses the turn clearly (the text kept, nothing half-stored), the event loop
that serves everyone else never waits on the database, and /health says degraded."""
import asyncio
import contextlib
import os
import sqlite3
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

import storage.store
from server.routes import create_app
from storage import Store, StoreUnavailable
from tests.fakes import FakeEngineClient
from ui.handlers import ChatHandlers


def tab(name: str):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}")


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(storage.store, "BUSY_TIMEOUT_S", 0.5)  # a lock outlasts it quickly
    return Store(str(tmp_path / "chat.db"))


@contextlib.contextmanager
def lock_held(store):
    """Another connection (as another process would) holds the write lock meanwhile."""
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        yield store
    finally:
        other.execute("ROLLBACK")
        other.close()


@pytest.fixture
def locked(store):
    with lock_held(store):
        yield store


def test_a_deleted_database_file_is_refused_not_silently_recreated_empty(store):
    sid = store.create_session("login:ann")
    os.remove(store.path)
    with pytest.raises(StoreUnavailable, match="deleted or replaced"):
        store.add_message("login:ann", sid, "user", "Hello", [])
    with pytest.raises(StoreUnavailable):
        store.messages("login:ann", sid)
    assert not os.path.exists(store.path)  # SQLite was not allowed to make a new, empty file
    assert "deleted or replaced" in store.health()


def test_a_replaced_database_file_is_refused_too(store, tmp_path):
    other = Store(str(tmp_path / "other.db"))
    os.replace(other.path, store.path)  # same name, another file (no schema of ours, or old data)
    with pytest.raises(StoreUnavailable, match="deleted or replaced"):
        store.sessions("login:ann")


def test_a_lock_held_by_another_process_fails_writes_after_the_busy_timeout_and_reads_go_on(locked):
    sid = None
    with pytest.raises(StoreUnavailable, match="locked"):
        sid = locked.create_session("login:ann")
    assert sid is None and "locked" in locked.health()
    assert locked.sessions("login:ann") == []  # WAL: readers are not blocked by the writer's lock


def test_health_is_ok_again_once_the_lock_is_gone(store):
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with pytest.raises(StoreUnavailable):
        store.create_session("login:ann")
    other.execute("ROLLBACK")
    store.create_session("login:ann")
    assert store.health() is None


def test_a_turn_on_a_locked_database_keeps_the_text_stores_nothing_and_never_blocks_the_loop(store, smol_tokenizer):
    chat = ChatHandlers(FakeEngineClient(smol_tokenizer), store)
    uid, sid = chat.current(None, None, tab("ann"))

    async def scenario():
        ticks = 0

        async def heartbeat():  # what /health, /metrics and other chats need: the loop free
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.ensure_future(heartbeat())
        with lock_held(store):
            updates = [u async for u in chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, request=tab("ann"))]
        beat.cancel()
        return updates, ticks

    updates, ticks = asyncio.run(scenario())
    assert updates[-1][1] == "Where is my parcel?"  # back in the box, as typed
    assert ticks >= 20  # the loop ran on through the 0.5 s the database made the turn wait
    assert chat.client.requests == []  # the engine was never asked
    assert store.messages(uid, sid) == []  # nothing half-stored: sending again makes no duplicate


def test_health_says_degraded_while_the_database_cannot_serve(store, smol_tokenizer):
    app = create_app(FakeEngineClient(smol_tokenizer))
    app.state.settings.health_checks["storage"] = store.health
    http = TestClient(app)
    assert http.get("/health").json() == {"status": "ok"}
    os.remove(store.path)
    answer = http.get("/health")
    assert answer.status_code == 200 and answer.json()["status"] == "degraded"
    assert "deleted or replaced" in answer.json()["storage"]


def test_a_read_only_database_refuses_writes_clearly_and_reads_go_on(store):
    """As a read-only mount or file would (root ignores a chmod here, so the file is opened read-only)."""
    sid = store.create_session("login:ann")
    store._uri = store._uri.replace("mode=rw", "mode=ro")
    with pytest.raises(StoreUnavailable, match="readonly"):
        store.add_message("login:ann", sid, "user", "Hello", [])
    assert "readonly" in store.health()
    assert store.messages("login:ann", sid) == []  # reads still serve
