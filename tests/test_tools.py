"""Fast tier: tool calling without a model. The grammar (llguidance on SmolLM2's tokenizer) accepts
exactly the calls a tool's schema allows; replies are read back the same streamed or whole; the
routes answer OpenAI's shapes (message.tool_calls, delta.tool_calls) against a scripted engine."""
import json

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
from fastapi.testclient import TestClient

from engine.tool_calls import CLOSE, OPEN, ToolCallParser, parse_reply
from engine.tools import call_text, parse_tools, render, template_inputs
from server.routes import create_app
from tests.fakes import FakeEngineClient

ORDER_SCHEMA = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^NW[0-9]{8}$"},
                                                 "email": {"type": "string"}},
                "required": ["order_id"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "An order's status.",
                                           "parameters": ORDER_SCHEMA}},
         {"type": "function", "function": {"name": "handoff", "parameters": {
             "type": "object", "properties": {"reason": {"type": "string"}}, "required": ["reason"]}}}]
CALL = call_text("lookup_order", {"order_id": "NW20481377"})


@pytest.fixture(scope="module")
def matcher_for(smol_tokenizer):
    ll = llguidance.hf.from_tokenizer(smol_tokenizer, n_vocab=len(smol_tokenizer))

    def make(choice, parallel=True):
        return llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(
            parse_tools(TOOLS, choice, parallel).grammar))
    return make


def accepts(matcher, tokenizer, text: str) -> bool:
    ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("choice, text, ok", [
    ("required", CALL, True),
    ("required", "Sure, one moment.", False),
    ("required", call_text("lookup_order", {"order_id": "12345"}), False),  # the pattern
    ("required", call_text("lookup_order", {"order_id": "NW20481377", "coupon": "x"}), False),  # extra key
    ("required", call_text("refund", {"order_id": "NW20481377"}), False),  # not a tool
    ("required", CALL + "\n" + call_text("handoff", {"reason": "angry"}), True),
    ("required", CALL + "\n" * 40, False),  # no endless newlines after a call (they once ran to max_tokens)
    ({"type": "function", "function": {"name": "handoff"}}, CALL, False),
    ({"type": "function", "function": {"name": "handoff"}}, call_text("handoff", {"reason": "asked"}), True),
    ("auto", "Our hours are 8 to 8. <tool shed> is not a call.", True),
    ("auto", "Let me check.\n" + CALL, True),
    ("auto", "Let me check. " + OPEN + '{"name": "lookup_order", "arguments": {"order_id": "nope"}}' + CLOSE, False),
])
def test_the_grammar_admits_exactly_the_calls_the_schema_allows(matcher_for, smol_tokenizer, choice, text, ok):
    assert accepts(matcher_for(choice), smol_tokenizer, text) is ok


def test_a_reply_holds_at_most_max_calls(matcher_for, smol_tokenizer):
    from engine.tools import MAX_CALLS

    assert accepts(matcher_for("required"), smol_tokenizer, "\n".join([CALL] * MAX_CALLS))
    assert not accepts(matcher_for("required"), smol_tokenizer, "\n".join([CALL] * (MAX_CALLS + 1)))
    assert not accepts(matcher_for("auto"), smol_tokenizer, "Sure. " + "\n".join([CALL] * (MAX_CALLS + 1)))


def test_without_parallel_calls_one_call_ends_the_reply(matcher_for, smol_tokenizer):
    two = CALL + "\n" + call_text("handoff", {"reason": "x"})
    assert accepts(matcher_for("required", parallel=True), smol_tokenizer, two)
    assert not accepts(matcher_for("required", parallel=False), smol_tokenizer, two)


def test_a_started_call_can_only_continue_as_a_call(matcher_for, smol_tokenizer):
    """In auto, once the opening tag is written, free text is no longer allowed."""
    m = matcher_for("auto")
    for t in smol_tokenizer.encode("Let me look. " + OPEN, add_special_tokens=False):
        assert m.consume_token(t)
    assert not m.is_accepting()  # the reply cannot end inside a call
    assert not m.consume_token(smol_tokenizer.encode(" Thanks", add_special_tokens=False)[0])  # nor go on as text


@pytest.mark.parametrize("bad, param", [
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}}], "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(bad, param):
    with pytest.raises(ValueError) as e:
        parse_tools(bad)
    assert e.value.parameter == param and param in str(e.value)


def test_references_to_the_tools_own_definitions_resolve(matcher_for, smol_tokenizer):
    tools = [{"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"speed": {"enum": ["standard", "express"]}},
        "properties": {"speed": {"$ref": "#/$defs/speed"}}, "required": ["speed"]}}}]
    ll = llguidance.hf.from_tokenizer(smol_tokenizer, n_vocab=len(smol_tokenizer))
    make = lambda: llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(parse_tools(tools, "required").grammar))  # noqa: E731
    assert accepts(make(), smol_tokenizer, call_text("ship", {"speed": "express"}))
    assert not accepts(make(), smol_tokenizer, call_text("ship", {"speed": "teleport"}))


@pytest.mark.parametrize("text", [
    "Sure.\n" + CALL,
    CALL + "\n\n" + call_text("handoff", {"reason": 'says "}" and \\ a lot'}),
    "No calls here, just <tool talk>.",
    OPEN + '{"name": "lookup_order", "arguments": {"order_id": "NW2048',  # cut by max_tokens
])
def test_a_reply_reads_the_same_streamed_piece_by_piece_or_whole(text):
    content, calls = parse_reply(text)
    parser, deltas = ToolCallParser(), []
    for ch in text:
        deltas += parser.feed(ch)
    deltas += parser.finish()
    streamed_args: dict[int, str] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            streamed_args[c["index"]] = streamed_args.get(c["index"], "") + c["function"]["arguments"]
    assert "".join(d.get("content", "") for d in deltas).strip() == (content or "")
    assert OPEN not in (content or "") and "order_id" not in (content or "")
    # every streamed call (a cut one too, its arguments as far as written) is in the whole reply's
    assert sorted(streamed_args) == list(range(len(calls)))
    assert [streamed_args[i] for i in range(len(calls))] == [c.arguments for c in calls]
    for call in parser.calls:
        json.loads(call.arguments)
    assert (parser.cut is not None) == text.endswith("NW2048")


def test_generic_format_puts_tools_in_the_system_message_and_results_in_user_turns(smol_tokenizer):
    plan = parse_tools(TOOLS)
    conversation = [{"role": "system", "content": "You are Sam."}, {"role": "user", "content": "Where is NW20481377?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                        "name": "lookup_order", "arguments": '{"order_id": "NW20481377"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'}]
    messages, extra = template_inputs(conversation, plan, native=False)
    assert extra == {} and messages[0]["content"].startswith("You are Sam.") and "lookup_order" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": CALL}
    assert messages[3]["role"] == "user" and '{"status": "shipped"}' in messages[3]["content"]
    text = smol_tokenizer.decode(render(smol_tokenizer, conversation, plan))
    assert CALL in text and text.endswith("<|im_start|>assistant\n")
    none = render(smol_tokenizer, conversation[:2], parse_tools(TOOLS, "none"))
    assert "lookup_order" not in smol_tokenizer.decode(none)  # tool_choice none: the tools stay out of the prompt


# ---- the routes, against a scripted engine ----------------------------------------------------
@pytest.fixture
def scripted(smol_tokenizer):
    def make(reply: str):
        fake = FakeEngineClient(smol_tokenizer, reply=reply, max_model_len=2048)
        return fake, TestClient(create_app(fake))
    return make


def test_a_call_comes_back_as_message_tool_calls(scripted):
    fake, http = scripted("Let me check that.\n" + CALL)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Where is NW20481377?"}],
                                                "tools": TOOLS, "tool_choice": "auto"})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check that."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "lookup_order"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ORDER_SCHEMA)
    assert fake.requests[-1]["params"].structured_outputs.grammar == parse_tools(TOOLS).grammar


def test_streamed_calls_arrive_head_first_then_argument_fragments(scripted):
    fake, http = scripted(CALL + "\n" + call_text("handoff", {"reason": "wants a person"}))
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required", "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    heads = [c for c in calls if "id" in c]
    assert [h["function"]["name"] for h in heads] == ["lookup_order", "handoff"] and [h["index"] for h in heads] == [0, 1]
    args = ["".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)]
    assert json.loads(args[0]) == {"order_id": "NW20481377"} and json.loads(args[1]) == {"reason": "wants a person"}
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_cut_by_max_tokens_comes_back_the_same_whole_or_streamed(scripted):
    """As OpenAI's: the call stays, its arguments as far as they were written, finish_reason "length"
    (it was dropped from the whole reply while its pieces had already been streamed)."""
    fake, http = scripted(CALL)
    cut_at = len(fake.info.tokenizer.encode(CALL, add_special_tokens=False)) - 4
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required",
            "max_tokens": cut_at}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup_order"
    written = call["function"]["arguments"]
    assert written and json.dumps({"order_id": "NW20481377"}).startswith(written)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(c["function"]["arguments"] for c in streamed) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_reads_streamed_calls(scripted):
    """The official client's stream accumulation reassembles our deltas into a call."""
    fake, http = scripted("One moment. " + CALL)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    with client.chat.completions.stream(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                        tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "One moment."
    assert message.tool_calls[0].function.name == "lookup_order"
    assert json.loads(message.tool_calls[0].function.arguments) == {"order_id": "NW20481377"}


def test_tool_choice_none_sends_no_grammar_and_no_tools(scripted):
    fake, http = scripted("We open at eight.")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hours?"}], "tools": TOOLS,
                                                "tool_choice": "none"})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "We open at eight."}
    assert fake.requests[-1]["params"].structured_outputs is None
    assert "lookup_order" not in fake.info.tokenizer.decode(fake.requests[-1]["prompt"])
