"""Fast tier: the chat's tool loop against a scripted engine and a real store: a triggered call is
run, its result goes back to the model as a tool message, the answer is stored with the call, and
the next turn continues token for token; failures become a line in the chat, never a crash."""
import asyncio
import json
import socket
from types import SimpleNamespace

import pytest

from engine.tools import ToolPlan, call_text
from storage import Store
from tests.fakes import FakeEngineClient, press_stop
from ui import actions
from ui.handlers import ChatHandlers

ASK = "Where is my order NW20481377? It is dana@example.com"  # the number and the address it was placed with
CALL = call_text("lookup_order", {"order_id": "NW20481377"})
ANSWER = " Your tent shipped with UPS and should arrive on December 4."


def tab(name="alice"):
    return SimpleNamespace(username=name, session_hash="tab-1")


@pytest.fixture
def fake(smol_tokenizer):
    return FakeEngineClient(smol_tokenizer, max_model_len=4096)


@pytest.fixture
def chat(fake, tmp_path):
    return ChatHandlers(fake, Store(str(tmp_path / "chat.db")), demo=False)


def send(chat, text, who="alice"):
    async def run():
        uid, sid = chat.current(None, None, tab(who))
        return uid, sid, [u async for u in chat.send(uid, sid, text, request=tab(who))]
    return asyncio.run(run())


def test_an_order_number_calls_lookup_order_and_the_answer_comes_from_its_result(chat, fake):
    fake.next_replies = [CALL, ANSWER]
    uid, sid, updates = send(chat, ASK)
    first, second = fake.requests[-2:]
    tools = [t.tool for t in actions.chat_tools(actions.DEFAULT_TOOLS)]
    grammar = first["params"].structured_outputs.grammar
    assert grammar == ToolPlan(actions.narrowed(tools, ASK), "lookup_order", False).grammar
    assert '"order_id": {"enum": ["NW20481377"]}' in grammar  # only a number the customer wrote
    decode = fake.info.tokenizer.decode
    assert "lookup_order" in decode(first["prompt"])  # the tools are in the prompt
    assert second["prompt"][:len(first["prompt"])] == first["prompt"]  # the same prefix, then the call
    tail = decode(second["prompt"][len(first["prompt"]):])
    assert tail.startswith(CALL) and "is shipped" in tail and "UPS" in tail and "dana@" not in tail  # not the row's e-mail
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["content"] == ANSWER and reply["finish_reason"] == "stop"
    (record,) = reply["tool_calls"]
    assert record["name"] == "lookup_order" and json.loads(record["arguments"]) == {"order_id": "NW20481377"}
    assert "Carrier: UPS" in record["result"] and record["error"] is None
    shown = updates[-1][0][-1]["content"]
    assert "<details>" in shown and "lookup_order" in shown and CALL not in shown
    # the next turn starts with every token the engine saw: prompt, call, result, answer
    fake.next_replies = ["Anything else?"]
    send(chat, "Thanks!")
    assert fake.requests[-1]["prompt"][:len(second["prompt"])] == second["prompt"]
    assert fake.requests[-1]["prompt"][len(second["prompt"]):][:len(reply["token_ids"]) - (
        len(second["prompt"]) - len(first["prompt"]))] == fake.info.tokenizer.encode(ANSWER, add_special_tokens=False)


def test_an_unknown_order_is_a_result_the_model_reads(chat, fake):
    fake.next_replies = [call_text("lookup_order", {"order_id": "NW99999999"}), " I could not find that order."]
    uid, sid, _ = send(chat, "Where is NW99999999? dana@example.com")
    record = chat.store.messages(uid, sid)[-1]["tool_calls"][0]
    assert "No order NW99999999 was placed with the e-mail address" in record["result"] and record["error"] is None


def test_a_number_with_another_shops_prefix_is_looked_up_and_not_found(chat, fake):
    fake.next_replies = [call_text("lookup_order", {"order_id": "VC-12345678"}), " I cannot find that order."]
    uid, sid, _ = send(chat, "Where is my order VC-12345678? lee@example.com")
    record = chat.store.messages(uid, sid)[-1]["tool_calls"][0]
    assert "No order VC12345678" in record["result"]


def result_for(chat, fake, text: str, number: str, who: str) -> str:
    fake.next_replies = [call_text("lookup_order", {"order_id": number}), " Let me check."]
    uid, sid, _ = send(chat, text, who)
    return chat.store.messages(uid, sid)[-1]["tool_calls"][0]["result"]


def test_an_order_is_told_only_to_whoever_gives_its_e_mail_address(chat, fake):
    """Order numbers are sequential: a number alone tells nothing, not even whether the order exists."""
    real = result_for(chat, fake, "Where is NW20481378?", "NW20481378", "eve")
    made_up = result_for(chat, fake, "Where is NW20481399?", "NW20481399", "mal")
    assert "once the customer gives the e-mail address" in real and "processing" not in real
    assert real.replace("NW20481378", "N") == made_up.replace("NW20481399", "N")  # the same words either way
    wrong = result_for(chat, fake, "Where is NW20481378? I am dana@example.com", "NW20481378", "mal2")
    assert "No order NW20481378 was placed with" in wrong and "Rain jacket" not in wrong
    right = result_for(chat, fake, "Where is NW20481378? LEE@Example.com.", "NW20481378", "lee")
    assert "is processing" in right and "Rain jacket" in right


def test_the_address_given_after_the_number_looks_the_order_up(chat, fake):
    """The customer answers the question for the address: that message runs lookup_order (required),
    held by the grammar to the number they wrote before."""
    fake.next_replies = [call_text("lookup_order", {"order_id": "NW20481377"}), " What is your e-mail address?"]
    uid, sid, _ = send(chat, "Where is my order nw-20481377?")
    assert "once the customer gives the e-mail address" in chat.store.messages(uid, sid)[-1]["tool_calls"][0]["result"]
    fake.next_replies = [call_text("lookup_order", {"order_id": "NW20481377"}), " It shipped."]
    send(chat, "sure, dana@example.com")
    grammar = fake.requests[-2]["params"].structured_outputs.grammar
    assert grammar.startswith('start: "<tool_call>"') and '{"enum": ["NW20481377"]}' in grammar
    assert "is shipped" in chat.store.messages(uid, sid)[-1]["tool_calls"][0]["result"]
    fake.next_replies = [" Noted."]
    send(chat, "Please send the catalogue to dana@example.com", who="gil")  # no order number in this chat
    tools = [t.tool for t in actions.chat_tools(actions.DEFAULT_TOOLS)]
    assert fake.requests[-1]["params"].structured_outputs.grammar == ToolPlan(tools, "auto", False).grammar


def test_an_order_stored_without_an_e_mail_address_is_told_by_its_number(chat, fake):
    with chat.store._db() as db:
        db["orders"].insert({"order_id": "NW55555555", "status": "shipped", "items": "Tent pegs"})
    assert "Tent pegs" in result_for(chat, fake, "Where is NW55555555?", "NW55555555", "fay")


def test_a_message_without_a_trigger_leaves_the_choice_to_the_model(chat, fake):
    send(chat, "What are your hours?")
    tools = [t.tool for t in actions.chat_tools(actions.DEFAULT_TOOLS)]
    assert fake.requests[-1]["params"].structured_outputs.grammar == ToolPlan(tools, "auto", False).grammar


def test_the_handoff_tool_asks_for_a_person(chat, fake):
    fake.next_replies = [call_text("handoff", {"reason": "the customer is upset"}), " A colleague will join you."]
    uid, sid, _ = send(chat, "This is useless.")
    assert chat.handoff.state(sid)["state"] == "waiting"
    assert chat.store.messages(uid, sid)[-1]["content"] == " A colleague will join you."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tool_that_cannot_be_reached_is_a_clear_line_and_the_reply_goes_on(chat, fake):
    tools = [{"name": "track", "url": f"http://127.0.0.1:{free_port()}/track", "method": "GET", "timeout_s": 2,
              "when": r"\btrack\b", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}]
    a = chat.store.assistant("support")
    chat.store.save_assistant("support", {**a, "tools": actions.check(tools)}, "op")
    fake.next_replies = [call_text("track", {"code": "1Z"}), " Sorry, tracking is down right now."]
    uid, sid, updates = send(chat, "Please track 1Z")
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["content"] == " Sorry, tracking is down right now."
    assert "could not be reached" in reply["tool_calls"][0]["error"]
    assert "⚠ track could not be reached" in updates[-1][0][-1]["content"]
    assert "error" in json.loads(reply["tool_calls"][0]["result"])


@pytest.mark.parametrize("entries, fragment", [
    ([{"builtin": "refund_everything"}], "builtin"),
    ([{"name": "x", "url": "ftp://files"}], "url"),
    ([{"name": "x", "url": "http://a", "timeout_s": 600}], "timeout_s"),
    ([{"builtin": "handoff", "when": "(("}], "when"),
    ([{"name": "x", "url": "http://a", "parameters": {"type": "object", "properties": {"y": {"type": "nope"}}}}],
     "grammar"),
    ([{"builtin": "handoff"}, {"builtin": "handoff"}], "twice"),
    ("not json", "tools"),
])
def test_bad_tool_entries_are_refused_naming_the_problem(entries, fragment):
    with pytest.raises(ValueError) as e:
        actions.check(entries)
    assert fragment in str(e.value)


def test_tools_belong_to_the_assistant_version_a_chat_started_with(chat, fake):
    from ui.console import AssistantEditor
    from ui.operator import OperatorHandlers

    operator = OperatorHandlers(fake, chat.store, {"m": None}, None, {"olga"})
    editor = AssistantEditor(chat.store, operator)
    uid, sid, _ = send(chat, "hello")  # a chat on version 1 (with the shipped tools)
    shown = editor.show("support", tab("olga"))
    assert json.loads(shown[11]) == actions.DEFAULT_TOOLS
    a = chat.store.assistant("support")
    args = ("support", a["name"], a["system_prompt"], a["greeting"], None, None, None, None, "", "", "")
    assert editor.save(*args, '[{"builtin": "nope"}]', request=tab("olga"))[0].startswith("❌")
    assert editor.save(*args, "[]", request=tab("olga"))[0].startswith("✅")
    send(chat, "Where is NW20481377?")  # the old chat keeps its version's tools
    assert "lookup_order" in fake.info.tokenizer.decode(fake.requests[-1]["prompt"])
    new = chat.store.create_session(uid, assistant="support", assistant_version=2,
                                    system_prompt=a["system_prompt"])
    asyncio.run(_drain(chat.send(uid, new, "Where is NW20481377?", request=tab())))
    assert fake.requests[-1]["params"].structured_outputs is None  # version 2 has no tools
    assert "lookup_order" not in fake.info.tokenizer.decode(fake.requests[-1]["prompt"])


async def _drain(gen):
    return [u async for u in gen]


def test_exports_carry_the_calls_with_the_turn(chat, fake):
    fake.next_replies = [CALL, ANSWER]
    uid, sid, _ = send(chat, ASK)
    exported = json.load(open(chat.export(uid, sid, "json", tab())))
    reply = exported["messages"][-1]
    assert reply["tool_calls"][0]["name"] == "lookup_order" and "UPS" in reply["tool_calls"][0]["result"]
    assert exported["system_prompt"] == "" and reply["token_ids"] == []  # still nothing of the instructions
    md = open(chat.export(uid, sid, "md", tab())).read()
    assert "Tool lookup_order" in md and "Carrier: UPS" in md


@pytest.fixture
def endpoint():
    """A local HTTP tool: /slow answers after the client gave up, /garbage answers HTML, /ok answers JSON."""
    import threading

    from tests.serving import local_site

    release = threading.Event()

    def answer(request):
        if request.path.startswith("/slow"):
            release.wait(10)
        body = b"<html>oops</html>" if request.path.startswith("/garbage") else b'{"status": "in transit"}'
        request.send_response(200)
        request.end_headers()
        request.wfile.write(body)
    with local_site(answer) as url:
        try:
            yield url
        finally:
            release.set()


@pytest.mark.parametrize("path, says", [("/slow", "did not answer within 0.5 s"),
                                        ("/garbage", "answered something that is not JSON"), ("/ok", None)])
def test_a_slow_or_garbled_tool_is_a_clear_line_and_a_good_one_is_read(chat, fake, endpoint, path, says):
    tools = [{"name": "track", "url": endpoint + path, "method": "GET", "timeout_s": 0.5, "when": r"\btrack\b",
              "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}]
    a = chat.store.assistant("support")
    chat.store.save_assistant("support", {**a, "tools": actions.check(tools)}, "op")
    fake.next_replies = [call_text("track", {"code": "1Z"}), " Here is what I know."]
    uid, sid, updates = send(chat, "Please track 1Z")
    record = chat.store.messages(uid, sid)[-1]["tool_calls"][0]
    assert chat.store.messages(uid, sid)[-1]["content"] == " Here is what I know."  # the reply went on
    if says:
        assert says in record["error"] and f"⚠ track {says}" in updates[-1][0][-1]["content"]
    else:
        assert record["error"] is None and record["result"] == '{"status": "in transit"}'
        assert "in transit" in fake.info.tokenizer.decode(fake.requests[-1]["prompt"])  # the model read it


def test_stop_during_the_answer_aborts_it_at_once_and_keeps_the_call(chat, fake):
    fake.next_replies = [CALL, " Your tent shipped with UPS on Friday and should arrive by next Tuesday at the latest."]

    async def scenario():
        uid, sid = chat.current(None, None, tab())
        fake.gate = asyncio.Event()
        fake.gate.set()
        turn = chat.send(uid, sid, ASK, request=tab())
        while len(fake.requests) < 2:
            await turn.__anext__()  # through the call and its result, to the answer's first token
        fake.gate.clear()
        await press_stop(turn)
        assert fake.requests[-1]["request_id"] in fake.aborted  # at once, not when the generator is collected
        return uid, sid

    uid, sid = asyncio.run(scenario())
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["finish_reason"] == "abort" and reply["tool_calls"][0]["name"] == "lookup_order"
    assert 0 < reply["generated_tokens"] < 15
