"""Fast tier: handoff to a person. The customer asks (button or phrase, English or Korean), waits in
line while the model stays quiet, an agent takes the chat and replies, and hands it back; two
agents cannot hold one chat, and a waiting chat is still waiting after a restart."""
import asyncio
from types import SimpleNamespace

import gradio as gr
import pytest

from storage import Store
from tests.fakes import FakeEngineClient
from ui.handlers import ChatHandlers
from ui.inbox import MAX_REPLY_CHARS, InboxHandlers


def customer(name: str):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}",
                           request=SimpleNamespace(path_params={"assistant": "support"}))


def agent(name: str):
    return SimpleNamespace(username=name, session_hash=f"console-{name}")


async def drain(gen):
    return [update async for update in gen]


@pytest.fixture
def shop(smol_tokenizer, tmp_path):
    fake = FakeEngineClient(smol_tokenizer, max_model_len=1024)
    store = Store(str(tmp_path / "chat.db"))
    return SimpleNamespace(fake=fake, store=store, chat=ChatHandlers(fake, store, demo=False),
                           inbox=InboxHandlers(store, {"alex", "kim"}), path=str(tmp_path / "chat.db"))


def send(shop, who: str, text: str):
    uid, sid = shop.chat.current(None, None, customer(who))
    asyncio.run(drain(shop.chat.send(uid, sid, text, request=customer(who))))
    return uid, sid


def test_the_button_puts_the_chat_in_line_and_the_model_stays_quiet(shop):
    uid, sid = send(shop, "cara", "My tent arrived torn.")
    asked = len(shop.fake.requests)
    status, timer, person, back = shop.chat.ask_person(uid, sid, customer("cara"))
    assert "No one from our team is online" in status["value"] and "(number 1)" in status["value"]
    assert timer.active and back["visible"] and not person["visible"]  # the two buttons swap while it waits
    assert shop.inbox.rows("", agent("alex"))[2] == "Online now (a console open): alex"  # an agent's console is open
    uid2, sid2 = shop.chat.current(None, None, customer("dan"))
    assert "number 2 in line" in shop.chat.ask_person(uid2, sid2, customer("dan"))[0]["value"]
    send(shop, "cara", "Hello? Anyone?")
    assert len(shop.fake.requests) == asked  # stored for the person, not answered by the model
    assert shop.store.messages(uid, sid)[-1]["content"] == "Hello? Anyone?"


def test_asking_for_a_person_while_the_reply_streams_stays_in_the_box(shop, monkeypatch):
    """Turns alternate: the message is not stored (for a person or anyone) until the reply ends."""
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    uid, sid = shop.chat.current(None, None, customer("cara"))

    async def mid_reply():
        shop.fake.gate = asyncio.Event()
        first = asyncio.ensure_future(drain(shop.chat.send(uid, sid, "Where is my tent?", request=customer("cara"))))
        for _ in range(10_000):  # until the first turn is in flight (its worker threads may be slow under load)
            if sid in shop.chat.service.busy:
                break
            await asyncio.sleep(0.001)
        assert sid in shop.chat.service.busy
        asked = await drain(shop.chat.send(uid, sid, "talk to a person", request=customer("cara")))
        shop.fake.gate.set()
        await first
        return asked

    assert asyncio.run(mid_reply())[-1][1] == "talk to a person" and "still being written" in warnings[0]
    assert shop.chat.handoff.state(sid)["state"] == "assistant"
    assert [m["content"] for m in shop.store.messages(uid, sid)][0] == "Where is my tent?"
    assert len(shop.store.messages(uid, sid)) == 2


@pytest.mark.parametrize("text", ["상담원 연결 해주세요", "Can I talk to a person please?", "I want a HUMAN agent"])
def test_asking_in_words_hands_the_chat_over(shop, text):
    uid, sid = send(shop, "cara", text)
    assert shop.fake.requests == [] and shop.chat.handoff.state(sid)["state"] == "waiting"


def test_a_first_message_for_a_person_names_the_chat_as_a_model_turn_would(shop):
    uid, sid = send(shop, "cara", "I want a HUMAN agent about my order")
    assert shop.store.session(uid, sid)["title"] == "I want a HUMAN agent about my order"
    send(shop, "cara", "hello?")
    assert shop.store.session(uid, sid)["title"] == "I want a HUMAN agent about my order"  # the first names it


def test_an_agent_takes_replies_and_hands_back(shop):
    uid, sid = send(shop, "cara", "talk to a person")
    _, only_opened = shop.chat.current(None, None, customer("olga"))  # a chat page opened, nothing said
    rows, picker, _, waiting = shop.inbox.rows("", agent("alex"))
    assert waiting == 1  # the console tab's title counts it
    assert rows[0][0] == sid and rows[0][1] == "waiting for a person" and sid in picker["choices"]
    assert only_opened not in picker["choices"]
    picked, _, state = shop.inbox.pick_row(SimpleNamespace(row_value=rows[0]), agent("alex"))  # a click on the row
    assert picked == sid and "waiting for a person" in state
    _, state = shop.inbox.take(sid, agent("alex"))
    assert "with a person (alex)" in state
    chat, _, box = shop.inbox.reply(sid, "Sorry about the tent, I have sent a return label.", agent("alex"))
    assert box == "" and "return label" in chat[-1]["content"]
    shown, status, timer, _, back, seen = shop.chat.poll(uid, sid, 1, customer("cara"))
    assert "return label" in shown[-1]["content"] and "👤 alex" in shown[-1]["content"]
    assert "chatting with **alex**" in status["value"] and timer.active and seen == 2
    assert not back["visible"]  # a person has the chat: no going back to the assistant until they hand it back
    assert shop.chat.poll(uid, sid, seen, customer("cara"))[0] == gr.update()  # nothing new: no re-render
    shop.chat.rate(uid, sid, SimpleNamespace(index=1, liked=True), customer("cara"))
    assert shop.store.rated_replies()[0]["conversation"][-1]["author"] == "agent:alex"  # the review names them
    shop.inbox.hand_back(sid, agent("alex"))
    assert not shop.chat.person_status(uid, sid, customer("cara"))[1].active
    send(shop, "cara", "Thanks! And the tent pegs?")
    prompt = shop.fake.info.tokenizer.decode(shop.fake.requests[-1]["prompt"])
    assert "return label" in prompt  # the assistant answers on with the agent's turn in its history
    md = open(shop.chat.export_markdown(uid, sid, customer("cara"))).read()
    assert "**alex (agent)**" in md


def test_an_agent_finds_any_chat_by_its_words_customer_or_id(shop):
    """Not only the inbox: a chat from last week, by an order number the customer typed."""
    uid, sid = send(shop, "cara", "Where is NW20481377? It is 100% late")
    _, other = send(shop, "dan", "Do you ship to Canada?")
    with shop.store._db() as db:  # older than the inbox's last hour
        db.execute("update sessions set updated = 1 where id in (?, ?)", [sid, other])
    assert sid not in [row[0] for row in shop.inbox.rows("", agent("alex"))[0]]
    for words, found in (("nw2048", [sid]), ("100%", [sid]), ("1_0", []), ("%", [sid]), ("cara", [sid]), (other, [other]),
                         ("ship to", [other]), ("parcel ships", [other, sid])):  # the fake model's reply
        rows, picker, _, _ = shop.inbox.rows(f" {words} ", agent("alex"))
        assert sorted(row[0] for row in rows) == sorted(found), words
        assert picker["choices"] == [row[0] for row in rows]
    row = shop.inbox.rows("NW20481377", agent("alex"))[0][0]
    assert row[5] == uid and "NW20481377" in row[6]  # the customer, and the message that holds the words
    assert shop.inbox.pick_row(SimpleNamespace(row_value=row), agent("alex"))[0] == sid


def test_two_agents_cannot_hold_one_chat(shop, monkeypatch):
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    _, sid = send(shop, "cara", "talk to a person")
    shop.inbox.take(sid, agent("alex"))
    shop.inbox.take(sid, agent("kim"))
    assert warnings == ["alex already has this chat."]
    _, _, box = shop.inbox.reply(sid, "Kim here!", agent("kim"))
    assert box == "Kim here!" and "not yours to answer (alex has it)" in warnings[-1]
    assert all(m["content"] != "Kim here!" for m in shop.inbox.handoff.conversation(sid))
    shop.inbox.hand_back(sid, agent("kim"))
    assert shop.inbox.handoff.state(sid)["agent"] == "alex"


def test_an_oversized_reply_is_refused_and_kept(shop, monkeypatch):
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    _, sid = send(shop, "cara", "talk to a person")
    shop.inbox.take(sid, agent("alex"))
    text = "x" * (MAX_REPLY_CHARS + 1)
    assert shop.inbox.reply(sid, text, agent("alex"))[2] == text and "at most" in warnings[-1]


def test_only_agents_work_the_inbox(shop):
    _, sid = send(shop, "cara", "talk to a person")
    assert shop.inbox.rows("", customer("dan")) == (gr.update(),) * 4
    assert shop.inbox.rows(sid, customer("dan")) == (gr.update(),) * 4  # nor can they search
    with pytest.raises(gr.Error):
        shop.inbox.take(sid, customer("dan"))
    with pytest.raises(gr.Error):
        shop.inbox.reply(sid, "I am staff, honest", customer("dan"))


def test_a_waiting_chat_is_still_waiting_after_a_restart(shop):
    uid, sid = send(shop, "cara", "talk to a person")
    restarted = ChatHandlers(shop.fake, Store(shop.path), demo=False)
    status, timer, _, _ = restarted.person_status(uid, sid, customer("cara"))
    assert "(number 1)" in status["value"] and timer.active


def test_the_customer_may_go_back_to_the_assistant_while_no_one_has_taken_the_chat(shop):
    uid, sid = send(shop, "cara", "talk to a person")
    asked = len(shop.fake.requests)
    status, timer, person, back = shop.chat.back_to_assistant(uid, sid, customer("cara"))
    assert not status["visible"] and not timer.active and not back["visible"] and person["visible"]
    assert shop.inbox.rows("", agent("alex"))[0][0][1] != "waiting for a person"
    send(shop, "cara", "Never mind: how long do refunds take?")
    assert len(shop.fake.requests) == asked + 1  # the assistant answers again
    send(shop, "cara", "talk to a person")
    shop.inbox.take(sid, agent("alex"))
    shop.chat.back_to_assistant(uid, sid, customer("cara"))  # too late: alex has it
    assert shop.inbox.handoff.state(sid) == {"state": "agent", "agent": "alex", "place": None}


def test_a_deployment_without_agents_offers_no_person_and_the_assistant_answers(smol_tokenizer, tmp_path):
    fake = FakeEngineClient(smol_tokenizer, max_model_len=1024)
    chat = ChatHandlers(fake, Store(str(tmp_path / "chat.db")), demo=False, staffed=False)
    uid, sid = chat.current(None, None, customer("cara"))
    asyncio.run(drain(chat.send(uid, sid, "I want to talk to a person", request=customer("cara"))))
    assert len(fake.requests) == 1 and chat.store.messages(uid, sid)[-1]["role"] == "assistant"
    status, timer, person, _ = chat.ask_person(uid, sid, customer("cara"))  # a stale page's button does nothing
    assert not status["visible"] and not timer.active and not person["visible"]
    assert chat.handoff.state(sid)["state"] == "assistant"
    session = chat.store.session(uid, sid)
    assert "handoff" not in [t.name for t in chat.tools_of(session)]
    assert "handoff" in [t.name for t in ChatHandlers(fake, chat.store, demo=False).tools_of(session)]


def test_a_canned_shortcut_expands_in_the_box_before_it_is_sent(shop, monkeypatch):
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    monkeypatch.setattr(gr, "Info", lambda *a: None)
    uid, sid = send(shop, "cara", "talk to a person")
    shop.inbox.take(sid, agent("alex"))
    _, state, box = shop.inbox.reply(sid, "/refund", agent("alex"))
    assert box.startswith("Refunds go back") and "`/refund`" in state
    assert shop.chat.store.messages(uid, sid)[-1]["role"] == "user"  # expanded, not sent
    _, _, box = shop.inbox.reply(sid, "/nonsense", agent("alex"))
    assert box == "/nonsense" and "/label" in warnings[-1]
    shop.inbox.reply(sid, "Refunds go back within a week.", agent("alex"))
    assert shop.chat.store.messages(uid, sid)[-1]["author"] == "agent:alex"


def test_quick_replies_show_in_an_empty_chat_and_send_their_text(shop):
    chips = asyncio.run(drain(shop.chat.greeting(customer("cara"))))[-1][0]["examples"]
    assert {"text": "주문 조회"} in chips
    data = SimpleNamespace(value={"text": "Where is my order?"})
    box, shown, pending = shop.chat.stage_quick_reply([], data)
    assert pending == "Where is my order?" and shown[0]["content"] == "Where is my order?" and box == ""
