"""Fast tier: the chat page's handlers against a fake EngineClient and a real (temporary) store:
turns stored with their token ids, stop keeps the partial reply, sessions stay their owner's."""
import asyncio
import dataclasses
from types import SimpleNamespace

import gradio as gr
import pytest

from engine.client import EngineOverloadedError
from server.auth import VISITOR_COOKIE, VisitorCookie
from server.limits import UserLimiter
from storage import Store
from tests.fakes import FakeEngineClient, press_stop
from ui import downloads
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
    updates = asyncio.run(drain(chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, request=tab("alice"))))
    assert len(updates) > 3  # streamed, never touching the box (stage cleared it; the next message may be typed)
    assert all(box == gr.update() for _, box in updates)
    messages = chat.store.messages(uid, sid)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["token_ids"] == fake.requests[-1]["prompt"]
    assert messages[1]["token_ids"] == fake.reply_ids and messages[1]["finish_reason"] == "stop"
    assert fake.requests[-1]["session_id"] == sid  # the panel colours this chat's pages by it
    assert chat.store.session(uid, sid)["title"].startswith("Where is my parcel")


@pytest.mark.parametrize("text, title", [
    ("Tell me about your return policy in detail please.", "Tell me about your return policy in…"),
    ("  two\nlines ", "two lines"),
    ("https://example.com/a/very/long/address/without/spaces", "https://example.com/a/very/long/address…"),
    ("텐트 배송 언제 와요?", "텐트 배송 언제 와요?"),
])
def test_a_chat_is_titled_by_its_first_message_cut_at_a_word(chat, text, title):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, text, 0.0, 1.0, 8, request=tab("alice"))))
    assert chat.store.session(uid, sid)["title"] == title and len(title) <= 40


def test_a_new_chat_is_named_in_the_list_as_its_first_message_shows(chat):
    """name_at_once runs beside `send`, before anything is stored: the list shows the title the turn
    will store; a chat that has messages, or another user's, is left alone."""
    uid, sid = chat.current(None, None, tab("alice"))
    other = chat.new_chat(uid, request=tab("alice"))[1]
    listed, title = chat.name_at_once(uid, sid, "  Where is my parcel?\n", tab("alice"))
    assert title == "Where is my parcel?" and listed["value"] == sid
    assert dict((s, label) for label, s in listed["choices"]) == {sid: "Where is my parcel?", other: "New chat"}
    assert chat.store.session(uid, sid)["title"] == "New chat"  # shown, not stored
    asyncio.run(drain(chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 8, request=tab("alice"))))
    assert chat.store.session(uid, sid)["title"] == title  # what the turn stored is what was shown
    assert chat.name_at_once(uid, sid, "And a refund?", tab("alice")) == (gr.update(), gr.update())
    assert chat.name_at_once(None, other, "hi", tab("mallory")) == (gr.update(), gr.update())  # not theirs
    assert chat.name_at_once(uid, other, "   ", tab("alice")) == (gr.update(), gr.update())


def test_the_next_turn_starts_with_the_previous_turns_exact_tokens(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, "Hello", 0.0, 1.0, 64, request=tab("alice"))))
    first = fake.requests[-1]["prompt"] + fake.reply_ids
    asyncio.run(drain(chat.send(uid, sid, "And a refund?", 0.0, 1.0, 64, request=tab("alice"))))
    assert fake.requests[-1]["prompt"][:len(first)] == first


def test_stop_mid_reply_aborts_and_keeps_the_partial_reply(chat, fake):
    uid, sid = chat.current(None, None, tab("bob"))

    async def scenario():
        fake.gate = asyncio.Event()
        turn = chat.send(uid, sid, "Tell me a story", 0.0, 1.0, 64, request=tab("bob"))
        fake.gate.set()
        await turn.__anext__()
        await turn.__anext__()
        fake.gate.clear()
        await press_stop(turn)

    asyncio.run(scenario())
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["role"] == "assistant" and reply["finish_reason"] == "abort"
    assert 0 < reply["generated_tokens"] < len(fake.reply_ids)
    assert fake.requests[-1]["request_id"] in fake.aborted


@pytest.mark.parametrize("ended_by", ["stop", "tab closed"])
def test_stop_or_a_closed_tab_ends_a_turn_that_no_task_is_reading_and_frees_the_chat(chat, fake, ended_by):
    """Gradio's cancel can miss the turn (its task cancelled between two updates), and a closed tab
    reads nothing more: the turn is left parked after an update, and nothing would ever read the
    engine's abort. The Stop and tab-closed handlers end it: the engine request aborted, the reply
    stored as shown and marked, the chat free for the next turn."""
    uid, sid = chat.current(None, None, tab("erin"))
    chat.service.limiter = UserLimiter(1)  # one turn at a time for this user: a parked turn would hold it

    async def scenario():
        fake.gate = asyncio.Event()
        turn = chat.send(uid, sid, "Tell me a story", 0.0, 1.0, 64, request=tab("erin"))
        fake.gate.set()
        for _ in range(3):
            shown = await turn.__anext__()
        fake.gate.clear()  # parked after an update, as a turn whose event's task went away
        if ended_by == "stop":
            after_stop = await chat.stop(uid, sid, tab("erin"))
        else:
            await chat.tab_closed(tab("erin"))
            after_stop = chat.display(chat.store.messages(uid, sid))
        fake.gate.set()
        return shown[0], after_stop, await drain(chat.send(uid, sid, "And then?", 0.0, 1.0, 64, request=tab("erin")))

    shown, after_stop, next_turn = asyncio.run(scenario())
    stopped = chat.store.messages(uid, sid)[1]
    assert stopped["finish_reason"] == "abort" and stopped["content"] == shown[-1]["content"]
    assert fake.requests[0]["request_id"] in fake.aborted
    assert "stopped" in after_stop[1]["content"]  # what the tab shows after Stop: the stored reply, marked
    assert fake.info.tokenizer.decode(fake.reply_ids) in next_turn[-1][0][-1]["content"]  # answered, not refused
    assert [m["finish_reason"] for m in chat.store.messages(uid, sid)] == [None, "abort", None, "stop"]


def test_an_event_resumed_while_stop_closes_its_turn_ends_quietly(chat, fake, monkeypatch):
    """Stop closes a parked turn; its last write takes a while (a worker thread). If the event's task
    resumes meanwhile, it must end quietly, not fail with "generator already running"."""
    import threading
    import time

    from ui.reply import ReplyWriter

    uid, sid = chat.current(None, None, tab("finn"))
    write, writing = ReplyWriter._write, threading.Event()

    def slow_write(self, reason):
        if reason == "abort":
            writing.set()
            time.sleep(0.3)
        write(self, reason)

    monkeypatch.setattr(ReplyWriter, "_write", slow_write)

    async def scenario():
        fake.gate = asyncio.Event()
        turn = chat.send(uid, sid, "Tell me a story", 0.0, 1.0, 64, request=tab("finn"))
        fake.gate.set()
        for _ in range(3):
            await turn.__anext__()
        fake.gate.clear()  # parked after an update
        stopping = asyncio.ensure_future(chat.stop(uid, sid, tab("finn")))
        await asyncio.to_thread(writing.wait, 10)  # stop is closing the turn, in its last write
        rest = [u async for u in turn]  # the event resumes now
        await stopping
        return rest

    assert asyncio.run(scenario()) == []  # ended quietly
    assert chat.store.messages(uid, sid)[-1]["finish_reason"] == "abort"


def test_a_message_sent_while_the_model_loads_shows_a_loading_line_and_is_answered_when_ready(chat, fake):
    uid, sid = chat.current(None, None, tab("dana"))
    fake.start_loading()

    async def scenario():
        turn = chat.send(uid, sid, "Is the shop open on Sunday?", 0.0, 1.0, 64, request=tab("dana"))
        waiting = await turn.__anext__()
        page = chat.greeting(tab("dana"))
        placeholder = await page.__anext__()
        fake.finish_loading()
        return waiting, placeholder, [u async for u in page], [u async for u in turn]

    waiting, placeholder, after_load, rest = asyncio.run(scenario())
    shown = waiting[0]
    assert [m["role"] for m in shown] == ["user", "assistant"] and "loading the model" in shown[1]["content"]
    assert shown[0]["content"] == "Is the shop open on Sunday?" and waiting[1] == gr.update()
    assert "loading the model" in placeholder["placeholder"]
    assert after_load[-1]["placeholder"] == "Ask the support assistant anything."  # the demo page's hint, once ready
    assert [m["role"] for m in chat.store.messages(uid, sid)] == ["user", "assistant"]  # answered once ready
    assert fake.info.tokenizer.decode(fake.reply_ids) in rest[-1][0][-1]["content"]


def test_a_refused_turn_keeps_the_text_and_stores_nothing(chat, fake):
    uid, sid = chat.current(None, None, tab("carol"))
    fake.refuse_with = EngineOverloadedError("engine overloaded")
    updates = asyncio.run(drain(chat.send(uid, sid, "Hi there", 0.0, 1.0, 64, request=tab("carol"))))
    assert updates[-1][1] == "Hi there"
    assert chat.store.messages(uid, sid) == []  # not sent, so not stored: sending again makes no duplicate


def test_regenerate_replaces_the_reply_with_the_same_prompt(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, "Opening hours?", 0.0, 1.0, 64, request=tab("alice"))))
    before = chat.store.messages(uid, sid)
    asyncio.run(drain(chat.regenerate(uid, sid, 0.5, 1.0, 64, request=tab("alice"))))
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
    operator = OperatorHandlers(fake, None, {"default": None, "broken": "broken"}, None, {"olga"})
    assert operator.initial_choices() == (["none", "int8"], "none")

    async def statuses(label, who="olga"):
        return [s async for s in operator.switch(label, "none", tab(who))]

    with pytest.raises(gr.Error, match="operators"):
        asyncio.run(statuses("default", who="mallory"))
    assert fake.switches == []

    assert "could not load broken" in asyncio.run(statuses("broken"))[-1]
    assert asyncio.run(statuses("default"))[-1].startswith("✅") and fake.switches[-1] == (None, "none")


def test_feedback_is_stored_beside_the_reply_and_listed_for_operators(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    asyncio.run(drain(chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, request=tab("alice"))))
    rated_id, comment_row = chat.rate(uid, sid, gr.LikeData(None, {"index": 1, "value": "", "liked": False}),
                                      tab("alice"))
    assert comment_row["visible"] is True
    chat.comment(uid, sid, rated_id, "It did not answer my question.", tab("alice"))
    reply = chat.store.messages(uid, sid)[1]
    assert reply["feedback"] == -1 and reply["feedback_comment"] == "It did not answer my question."
    assert chat.marks(uid, sid, tab("alice"))["feedback_value"] == ["Dislike"]  # survives a reload
    operator = OperatorHandlers(fake, chat.store, {"m": None}, None, {"olga"})
    rows = operator.feedback_table(tab("olga"))
    assert rows[0][1:5] == ["down", "It did not answer my question.", "login:alice", "Where is my parcel?"]
    with pytest.raises(gr.Error):
        operator.feedback_table(tab("alice"))  # a visitor cannot read other people's chats
    jsonl = downloads.body(chat.store, "feedback.jsonl", 30).splitlines()
    assert '"role": "user"' in jsonl[0] and "Where is my parcel?" in jsonl[0]
    assert "It did not answer" in downloads.body(chat.store, "feedback.csv", 30)


@pytest.mark.parametrize("comment", ["=HYPERLINK(\"http://evil.example\",\"Click\")", "+cmd|' /C calc'!A0",
                                     "@SUM(1+1)*cmd|' /C calc'!A0", "-2+3+cmd|' /C calc'!A0", "\t=1+1"])
def test_a_customer_comment_never_becomes_a_formula_in_the_operators_csv(chat, comment):
    import csv
    import io

    uid, sid = chat.current(None, None, tab("mallory"))
    asyncio.run(drain(chat.send(uid, sid, "=1+1 is my question", 0.0, 1.0, 64, request=tab("mallory"))))
    rated_id, _ = chat.rate(uid, sid, gr.LikeData(None, {"index": 1, "value": "", "liked": False}), tab("mallory"))
    chat.comment(uid, sid, rated_id, comment, tab("mallory"))
    text = downloads.body(chat.store, "feedback.csv", 30)
    assert text.startswith("\ufeff")
    row = next(csv.DictReader(io.StringIO(text.removeprefix("\ufeff"), newline="")))
    assert row["comment"] == "'" + comment.strip()  # shown as typed, after a quote that keeps it text
    assert row["title"] == "'=1+1 is my question"
    assert not any(cell.startswith(("=", "+", "-", "@", "\t")) for cell in row.values())


def test_a_customers_own_markup_shows_as_typed_never_as_form_fields(chat):
    from ui.display import customer_display, display, plain_text

    typed = 'Hi <input type="text" value="card number"><details open><summary>x</summary></details><form>'
    uid, sid = chat.current(None, None, tab("mallory"))
    updates = asyncio.run(drain(chat.send(uid, sid, typed, 0.0, 1.0, 64, request=tab("mallory"))))
    staged = chat.stage(typed, [])[1][0]["content"]
    messages = chat.store.messages(uid, sid)
    for shown in (updates[-1][0][0]["content"], display(messages)[0]["content"],
                  customer_display(messages)[0]["content"], staged):
        assert "<input" not in shown and "<details" not in shown and "<form" not in shown
        assert "&lt;input" in shown
    assert messages[0]["content"] == typed  # stored as typed
    assert plain_text(display(messages)[0]["content"]) == typed  # an edit starts from the text as typed


def test_the_customer_sees_a_reply_that_did_not_end_end_in_an_ellipsis(chat):
    """No words (the view reads the same in any language): a reply cut by a restart, stopped, at its
    token limit, or still unfinished ends in "…"; a finished one, a person's, and one already ending so, do not get one."""
    from ui.display import customer_display

    def shown(content, reason, author=None):
        m = {"role": "assistant", "content": content, "finish_reason": reason, "created": 0, "author": author}
        return customer_display([m])[0]["content"].split("\n\n<sub>")[0]
    assert shown("Your parcel left our ", "interrupted") == "Your parcel left our …"
    assert shown("Your parcel left", "abort") == shown("Your parcel left", "streaming") == "Your parcel left …"
    assert shown("", "interrupted") == " …"
    assert shown("It arrives Monday.", "stop") == "It arrives Monday."
    assert shown("It arrives on", "length") == "It arrives on …"  # at max_tokens
    assert shown("Wait…", "interrupted") == "Wait…"
    assert shown("I am on it", None, "agent:alex") == "I am on it"


def test_an_exported_chat_imports_back_identical(chat):
    uid, sid = chat.current(None, None, tab("alice"))
    for text in ("Hello", "Can I get a refund?"):
        asyncio.run(drain(chat.send(uid, sid, text, 0.0, 1.0, 64, request=tab("alice"))))
    exported = chat.export_json(uid, sid, tab("alice"))
    assert "**Customer**" in open(chat.export_markdown(uid, sid, tab("alice"))).read()
    _, new_sid, *_ = chat.import_chat(uid, exported, tab("alice"))
    assert new_sid != sid
    keys = ("role", "content", "token_ids", "model", "created")
    assert [[m[k] for k in keys] for m in chat.store.messages(uid, new_sid)] == \
        [[m[k] for k in keys] for m in chat.store.messages(uid, sid)]
    assert chat.store.session(uid, new_sid)["system_prompt"] == chat.store.session(uid, sid)["system_prompt"]


@pytest.mark.parametrize("content, complaint", [
    ("{not json", "not a JSON file"), ('{"format": "other"}', "not a pagedchat chat export"),
    ('{"format": "pagedchat.chat/1", "messages": [{"role": "system", "content": "x"}]}', "role"),
    ('{"format": "pagedchat.chat/1", "messages": [{"role": "user", "content": "x", "token_ids": [-1]}]}', "token_ids"),
])
def test_a_bad_import_is_refused_with_the_reason(chat, tmp_path, content, complaint, monkeypatch):
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    uid, _ = chat.current(None, None, tab("alice"))
    path = tmp_path / "chat.json"
    path.write_text(content)
    before = chat.store.sessions(uid)
    chat.import_chat(uid, str(path), tab("alice"))
    assert chat.store.sessions(uid) == before and complaint in warnings[0]


def test_made_up_event_values_from_an_api_client_change_nothing(chat, monkeypatch):
    """The chatbot's events (a thumb, an edit) and the import take what Gradio's browser code sends; a
    client of the page's API may send anything instead."""
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    uid, sid = chat.current(None, None, tab("alice"))
    before = chat.store.sessions(uid)
    for junk in (None, "x", 5, {"index": 1}):
        assert chat.rate(uid, sid, junk, tab("alice")) == (None, gr.update(visible=False))

        async def edit():
            return [u async for u in chat.edit_from_here(uid, sid, data=junk, request=tab("alice"))]
        assert asyncio.run(edit()) == [(gr.update(), gr.update())]
        if not isinstance(junk, str):  # (a string is a path: Gradio gives the page's own uploads only)
            chat.import_chat(uid, junk, tab("alice"))
    assert [s["id"] for s in chat.store.sessions(uid)] == [s["id"] for s in before]
    assert len(warnings) == 3 and all("no file was given" in w for w in warnings)


def test_delete_all_removes_only_this_users_chats(chat):
    alice, _ = chat.current(None, None, tab("alice"))
    chat.new_chat(alice, "", tab("alice"))
    bob, bob_sid = chat.current(None, None, tab("bob"))
    *_, confirm_row = chat.delete_all(alice, tab("alice"))
    assert confirm_row["visible"] is False
    assert len(chat.store.sessions(alice)) == 1 and chat.store.messages(alice, chat.store.sessions(alice)[0]["id"]) == []
    assert chat.store.session(bob, bob_sid) is not None


def test_edit_and_resend_branches_and_keeps_the_untouched_prefix(chat, fake):
    uid, sid = chat.current(None, None, tab("alice"))
    for text in ("First question", "Second question", "Third question"):
        asyncio.run(drain(chat.send(uid, sid, text, 0.0, 1.0, 64, request=tab("alice"))))
    turn0 = fake.requests[0]["prompt"] + fake.reply_ids
    edit = gr.EditData(None, {"index": 2, "value": "Second question, reworded\n\n<sub>12:00</sub>",
                              "previous_value": "Second question"})
    asyncio.run(drain(chat.edit_from_here(uid, sid, 0.0, 1.0, 64, 1.1, edit, tab("alice"))))
    messages = chat.store.messages(uid, sid)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["First question", "Second question, reworded"]
    assert fake.requests[-1]["prompt"][:len(turn0)] == turn0  # turn 0 is still a cached prefix
    with chat.store._db() as db:  # the dropped turns are kept as a branch
        kept = [r["content"] for r in db.query("select content from messages where replaced is not null")]
    assert "Third question" in kept and "Second question" in kept


def test_a_long_conversation_drops_its_oldest_turns_and_says_so(smol_tokenizer, tmp_path):
    fake = FakeEngineClient(smol_tokenizer, max_model_len=256)
    chat = ChatHandlers(fake, Store(str(tmp_path / "chat.db")))
    uid, sid = chat.current(None, None, tab("alice"))
    chat.store.update_session(uid, sid, system_prompt="Be brief.")
    for i in range(10):
        asyncio.run(drain(chat.send(uid, sid, f"Question number {i} about my order NW2048137{i}.", 0.0, 1.0, 16,
                                    request=tab("alice"))))
    users = [m for m in chat.store.messages(uid, sid) if m["role"] == "user"]
    assert len(users) == 10 and users[-1]["trimmed_turns"] > 0  # all kept in the chat, not all in the prompt
    assert all(len(r["prompt"]) <= 256 - 16 for r in fake.requests)
    assert "left out" in chat.open_session(uid, sid, tab("alice"))[1][-2]["content"]
    same_window = [i for i in range(1, 10) if users[i]["trimmed_turns"] == users[i - 1]["trimmed_turns"] > 0]
    assert same_window  # after a trim, the next turn continues in the same window...
    i = same_window[0]
    previous = fake.requests[i - 1]["prompt"] + fake.reply_ids[:16]
    assert fake.requests[i]["prompt"][:len(previous)] == previous  # ...token-exact again


def test_sliders_take_the_models_sampling_defaults(smol_tokenizer, tmp_path):
    fake = FakeEngineClient(smol_tokenizer)
    fake.info = dataclasses.replace(fake.info, sampling_defaults={"temperature": 0.2, "top_p": 0.9},
                                    sampling_source="the model card")
    chat = ChatHandlers(fake, Store(str(tmp_path / "chat.db")))
    temperature, top_p, penalty, note = chat.sampling_defaults()
    assert (temperature, top_p, penalty) == (0.2, 0.9, 1.1) and "the model card" in note


def test_a_reply_is_stored_as_it_grows_and_a_crash_leaves_it_interrupted(chat, fake, monkeypatch):
    from ui.reply import ReplyWriter

    monkeypatch.setattr(ReplyWriter, "SAVE_EVERY_S", 0.0)  # write at every token
    uid, sid = chat.current(None, None, tab("alice"))

    async def crash_then_restart():
        turn = chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, request=tab("alice"))
        for _ in range(4):  # the staged message, then three tokens
            await turn.__anext__()
        stored = chat.store.messages(uid, sid)
        assert stored[-1]["role"] == "assistant" and stored[-1]["finish_reason"] == "streaming"
        assert stored[-1]["token_ids"] == fake.reply_ids[:3]
        # kill -9 here: the turn never runs again; a new process opens the same database
        restarted = Store(chat.store.path)
        assert restarted.mark_interrupted() == 1
        after = ChatHandlers(fake, restarted)
        assert "interrupted" in after.open_session(uid, sid, tab("alice"))[1][-1]["content"]
        await drain(after.send(uid, sid, "Hello again?", 0.0, 1.0, 64, request=tab("alice")))
        partial = fake.requests[0]["prompt"] + fake.reply_ids[:3]
        assert fake.requests[-1]["prompt"][:len(partial)] == partial  # the chat goes on from what was written

    asyncio.run(crash_then_restart())


def test_while_a_reply_streams_nothing_else_starts_or_changes_the_chat(chat, fake, monkeypatch):
    """While a reply streams, a message from its own tab stays in the box (the screen keeps the
    reply), regenerate and edit are refused before they touch the chat, and a message from another
    tab is refused too: turns alternate."""
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    uid, sid = chat.current(None, None, tab("alice"))

    async def while_one_streams():
        fake.gate = asyncio.Event()
        first = asyncio.ensure_future(drain(chat.send(uid, sid, "From tab one", 0.0, 1.0, 64,
                                                      request=tab("alice", "tab-1"))))
        for _ in range(10_000):  # until the first turn is in flight (its worker threads may be slow under load)
            if sid in chat.service.busy:
                break
            await asyncio.sleep(0.001)
        assert sid in chat.service.busy
        staged = chat.stage("Again from tab one", [], sid)
        same = await drain(chat.send(uid, sid, "Again from tab one", 0.0, 1.0, 64, request=tab("alice", "tab-1")))
        regenerated = await drain(chat.regenerate(uid, sid, 0.0, 1.0, 64, request=tab("alice", "tab-1")))
        edit = gr.EditData(None, {"index": 0, "value": "Edited", "previous_value": "From tab one"})
        edited = await drain(chat.edit_from_here(uid, sid, 0.0, 1.0, 64, 1.1, edit, tab("alice", "tab-1")))
        other = await drain(chat.send(uid, sid, "From tab two", 0.0, 1.0, 64, request=tab("alice", "tab-2")))
        fake.gate.set()
        await first
        return staged, same, regenerated, edited, other

    staged, same, regenerated, edited, other = asyncio.run(while_one_streams())
    assert staged == (gr.update(), gr.update(), "Again from tab one")  # not cleared, not shown as sent
    assert "still being written" in warnings[0] and same == [(gr.update(), "Again from tab one")]
    # regenerate and edit change nothing mid-reply (an edit branched the message being answered away)
    assert all("wait for it" in w for w in warnings[1:3]) and regenerated == [gr.update()]
    assert edited == [(gr.update(), gr.update())]
    assert "already answering" in warnings[3] and other[-1][1] == "From tab two"  # kept in that tab's box
    messages = chat.store.messages(uid, sid)
    assert [(m["role"], m["content"]) for m in messages][0] == ("user", "From tab one") and len(messages) == 2


def test_deleting_a_chat_while_it_streams_stops_the_reply_cleanly(chat, fake, monkeypatch):
    from ui.reply import ReplyWriter

    monkeypatch.setattr(ReplyWriter, "SAVE_EVERY_S", 0.0)
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    uid, sid = chat.current(None, None, tab("alice"))

    async def delete_mid_reply():
        updates = []
        async for update in chat.send(uid, sid, "Tell me everything", 0.0, 1.0, 64, request=tab("alice")):
            updates.append(update)
            if len(updates) == 3:
                chat.store.delete_session(uid, sid)
        return updates

    asyncio.run(delete_mid_reply())
    assert "deleted" in warnings[0]
    assert fake.requests[-1]["request_id"] in fake.aborted  # the engine stopped working on it
    assert chat.store.session(uid, sid) is None


def test_a_user_over_the_cap_is_told_to_wait_and_nothing_is_stored(fake, tmp_path):
    limiter = UserLimiter(1)
    chat = ChatHandlers(fake, Store(str(tmp_path / "chat.db")), limiter=limiter)
    uid, first = chat.current(None, None, tab("dan"))
    second = chat.new_chat(uid, "", tab("dan"))[1]
    warnings = []

    async def scenario():
        fake.gate = asyncio.Event()
        running = chat.send(uid, first, "Where is my parcel?", 0.0, 1.0, 64, request=tab("dan"))
        await running.__anext__()  # the first chat's turn holds dan's only slot
        over = await drain(chat.send(uid, second, "And my refund?", 0.0, 1.0, 64, request=tab("dan", "tab-2")))
        fake.gate.set()
        await drain(running)
        return over

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gr, "Warning", warnings.append)
        over = asyncio.run(scenario())
    assert "limit per user is 1" in warnings[0] and over[-1][1] == "And my refund?"
    assert chat.store.messages(uid, second) == [] and len(chat.store.messages(uid, first)) == 2
    assert limiter.in_flight(uid) == 0
    asyncio.run(drain(chat.send(uid, second, "And my refund?", 0.0, 1.0, 64, request=tab("dan"))))
    assert len(chat.store.messages(uid, second)) == 2  # once the first is done, the second goes


def test_visitors_are_known_by_the_signed_cookie_only(fake, tmp_path):
    cookie = VisitorCookie("server-secret")
    chat = ChatHandlers(fake, Store(str(tmp_path / "chat.db")), visitors=cookie)
    value = cookie.issue()
    visitor = SimpleNamespace(username=None, session_hash="t", cookies={VISITOR_COOKIE: value})
    assert chat.who(None, visitor) == f"visitor:{cookie.visitor(value)}"
    forged = SimpleNamespace(username=None, session_hash="t", cookies={VISITOR_COOKIE: "alice.0000"})
    assert chat.who(None, forged) == "tab:t"
    uid, sid = chat.init(visitor)[0], chat.init(visitor)[2]
    assert uid == chat.who(None, visitor) and chat.store.session(uid, sid) is not None


def test_salting_by_user_keeps_each_users_prefixes_apart(fake, tmp_path):
    shared = ChatHandlers(fake, Store(str(tmp_path / "a.db")))
    salted = ChatHandlers(fake, Store(str(tmp_path / "b.db")), salt_by_user=True)
    for chat in (shared, salted):
        for name in ("erin", "frank"):
            uid, sid = chat.current(None, None, tab(name))
            asyncio.run(drain(chat.send(uid, sid, "Hello", 0.0, 1.0, 8, request=tab(name))))
    assert [r["cache_salt"] for r in fake.requests] == [None, None, "user:login:erin", "user:login:frank"]


def test_a_reply_cut_by_a_vanished_engine_is_kept_as_interrupted_and_the_chat_goes_on(chat, fake, monkeypatch):
    uid, sid = chat.current(None, None, tab("erin"))
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    fake.die_after = 3
    updates = asyncio.run(drain(chat.send(uid, sid, "Where is my parcel?", 0.0, 1.0, 64, request=tab("erin"))))
    assert "went away" in warnings[0] and updates[-1][1] == gr.update()  # sent: the box stays as is
    messages = chat.store.messages(uid, sid)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["finish_reason"] == "interrupted" and messages[1]["token_ids"] == fake.reply_ids[:3]
    assert "interrupted" in updates[-1][0][-1]["content"]
    fake.die_after = None
    asyncio.run(drain(chat.send(uid, sid, "Hello again?", 0.0, 1.0, 64, request=tab("erin"))))
    assert fake.requests[-1]["prompt"][:len(messages[0]["token_ids"]) + 3] == messages[0]["token_ids"] + fake.reply_ids[:3]


def test_a_reloaded_page_shows_the_model_and_quantization_the_last_switch_loaded(fake, tmp_path):
    """The page is built once with the starting model: a reload after a switch showed those values
    whatever served. in_force (on load) gives the last switch's; a failed one changes nothing."""
    op = OperatorHandlers(fake, Store(str(tmp_path / "c.db")), {"start": None, "other": "/m/other", "bad": "broken"},
                          None, {"olga"})
    olga, cara = tab("olga"), tab("cara")
    assert op.in_force(olga) == (gr.update(), gr.update())  # no switch yet: the page's own values hold
    asyncio.run(drain(op.switch("other", "int8", request=olga)))
    model, quant = op.in_force(olga)
    assert model["value"] == "other" and quant["value"] == "int8" and quant["choices"] == ["none", "int8"]
    asyncio.run(drain(op.switch("bad", "none", request=olga)))  # fails: the other model still serves
    assert op.in_force(olga)[0]["value"] == "other"
    assert op.in_force(cara) == (gr.update(), gr.update())  # not an operator: nothing
