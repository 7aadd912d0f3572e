"""Fast tier: the chat page's handlers against a fake EngineClient and a real (temporary) store:
turns stored with their token ids, stop keeps the partial reply, sessions stay their owner's."""
import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from engine.client import EngineOverloadedError
from storage import Store
from tests.fakes import FakeEngineClient
from ui.handlers import ChatHandlers
from ui.operator import OperatorHandlers


def tab(name: str | None = None, session_hash: str = "tab-1"):
    return SimpleNamespace(username=name, session_hash=session_hash)


@pytest.fixture
def fake(smol_tokenizer):
    return FakeEngineClient(smol_tokenizer)


@pytest.fixture
def chat(fake, tmp_path):
    return ChatHandlers(fake, Store(str(tmp_path / "chat.db")))


async def drain(gen):
    return [update async for update in gen]


def test_a_turn_streams_then_stores_both_messages_with_token_ids(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    updates = asyncio.run(drain(chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, tab("alice"))))
    assert len(updates) > 3 and updates[-1][1] == ""  # streamed, then the box is cleared
    messages = chat.store.messages(uid, sid)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["token_ids"] == fake.requests[-1]["prompt"]
    assert messages[1]["token_ids"] == fake.reply_ids and messages[1]["finish_reason"] == "stop"
    assert fake.requests[-1]["session_id"] == sid  # the panel colours this chat's pages by it
    assert chat.store.session(uid, sid)["title"].startswith("Where is my parcel")


def test_the_next_turn_starts_with_the_previous_turns_exact_tokens(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, "Hello", 0.0, 1.0, 64, tab("alice"))))
    first = fake.requests[-1]["prompt"] + fake.reply_ids
    asyncio.run(drain(chat.send(uid, sid, "And a refund?", 0.0, 1.0, 64, tab("alice"))))
    assert fake.requests[-1]["prompt"][:len(first)] == first


def test_stop_mid_reply_aborts_and_keeps_the_partial_reply(chat, fake):
    uid, sid = chat.current(None, None, tab("bob"))

    async def scenario():
        fake.gate = asyncio.Event()
        turn = chat.send(uid, sid, "Tell me a story", 0.0, 1.0, 64, tab("bob"))
        fake.gate.set()
        await turn.__anext__()
        await turn.__anext__()
        fake.gate.clear()
        pending = asyncio.ensure_future(turn.__anext__())
        await asyncio.sleep(0.01)
        pending.cancel()  # what Stop does to the event's task
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await turn.aclose()

    asyncio.run(scenario())
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["role"] == "assistant" and reply["finish_reason"] == "abort"
    assert 0 < reply["generated_tokens"] < len(fake.reply_ids)
    assert fake.requests[-1]["request_id"] in fake.aborted


def test_a_refused_turn_keeps_the_text_and_stores_nothing(chat, fake):
    uid, sid = chat.current(None, None, tab("carol"))
    fake.refuse_with = EngineOverloadedError("engine overloaded")
    updates = asyncio.run(drain(chat.send(uid, sid, "Hi there", 0.0, 1.0, 64, tab("carol"))))
    assert updates[-1][1] == "Hi there"
    assert chat.store.messages(uid, sid) == []  # not sent, so not stored: sending again makes no duplicate


def test_regenerate_replaces_the_reply_with_the_same_prompt(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, "Opening hours?", 0.0, 1.0, 64, tab("alice"))))
    before = chat.store.messages(uid, sid)
    asyncio.run(drain(chat.regenerate(uid, sid, 0.5, 1.0, 64, tab("alice"))))
    after = chat.store.messages(uid, sid)
    assert len(after) == 2 and after[0] == before[0] and after[1]["created"] > before[1]["created"]
    assert fake.requests[-1]["prompt"] == fake.requests[-2]["prompt"]


def test_sessions_are_their_owners(chat):
    alice, sid = chat.current(None, None, tab("alice"))
    bob, _ = chat.current(None, None, tab("bob"))
    assert chat.open_session(bob, sid, tab("bob"))[1] == {"__type__": "update"}  # nothing of alice's
    chat.rename(bob, sid, "stolen", tab("bob"))  # bob's own session is renamed instead
    assert chat.store.session(alice, sid)["title"] != "stolen"
    assert {c[1] for c in chat.find(bob, "", tab("bob"))["choices"]}.isdisjoint({sid})


def test_operator_switch_reports_failure_and_success(fake):
    operator = OperatorHandlers(fake, {"default": None, "broken": "broken"}, None)
    assert operator.initial_choices() == (["none", "int8"], "none")

    async def statuses(label):
        return [s async for s in operator.switch(label, "none")]

    assert "could not load broken" in asyncio.run(statuses("broken"))[-1]
    assert asyncio.run(statuses("default"))[-1].startswith("✅") and fake.switches[-1] == (None, "none")
