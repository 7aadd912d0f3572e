"""Fast tier: /v1/messages (Anthropic's Messages API) against a fake EngineClient, through the official
`anthropic` client: the prompt a request renders, the message and its event stream, tool use and
tool results, token counting, keys in x-api-key, and refusals in Anthropic's error shape (the real
model through it: tests/test_openai_outputs.py)."""
import json

import anthropic
import pytest
from fastapi.testclient import TestClient

from engine.tools import call_text
from server.auth import Credentials
from server.routes import create_app
from tests.fakes import FakeEngineClient, serving_replies

WEATHER = [{"name": "get_weather", "description": "Today's weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = call_text("get_weather", {"city": "Paris"})


@pytest.fixture
def scripted(smol_tokenizer):
    def make(*replies: str):
        fake, http = serving_replies(smol_tokenizer, *replies)
        return fake, http, anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                                               max_retries=0)
    return make


def prompt_of(fake) -> str:
    return fake.info.tokenizer.decode(fake.requests[-1]["prompt"])


def without_ids(blocks) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]


def rendered(fake, messages: list[dict]) -> str:
    return fake.info.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_message_renders_the_chat_template_and_answers_in_anthropics_shape(scripted):
    fake, _, client = scripted("Your parcel ships today.")
    m = client.messages.create(model="fake-model", max_tokens=50, system="Be brief.", stop_sequences=["###"],
                               extra_body={"temperature": 0.2, "top_k": 5},  # the client's own fields no longer
                               messages=[{"role": "user",
                                          "content": [{"type": "text", "text": "Where is my parcel?"}]}])
    assert prompt_of(fake) == rendered(fake, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Where is my parcel?"}])
    params = fake.requests[-1]["params"]
    assert (params.max_tokens, params.temperature, params.top_k, params.stop_strings) == (50, 0.2, 5, ["###"])
    assert m.type == "message" and m.role == "assistant" and m.model == "fake-model" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Your parcel ships today."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    prompt = len(fake.requests[-1]["prompt"])
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt
    assert u.output_tokens == len(fake.info.tokenizer.encode("Your parcel ships today.", add_special_tokens=False))


def test_max_tokens_stops_with_max_tokens(scripted):
    fake, _, client = scripted("Your parcel ships today, by courier.")
    m = client.messages.create(model="fake-model", max_tokens=2, messages=[{"role": "user", "content": "Where?"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2


def test_tool_use_and_its_result_round_trip(scripted):
    fake, _, client = scripted("Let me check.\n" + CALL, "It is sunny in Paris.")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = client.messages.create(model="fake-model", max_tokens=100, tools=WEATHER, messages=ask)
    assert fake.requests[-1]["params"].structured_outputs.grammar and "get_weather" in prompt_of(fake)
    text, use = m.content
    assert text.text == "Let me check." and use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "Paris"} and m.stop_reason == "tool_use"
    answer = client.messages.create(model="fake-model", max_tokens=100, tools=WEATHER, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}]}])
    assert answer.content[0].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"
    prompt = prompt_of(fake)
    assert prompt.index("Weather in Paris?") < prompt.index('"city": "Paris"') < prompt.index("sunny, 21C")
    client.messages.create(model="fake-model", max_tokens=100, tools=WEATHER, messages=ask,
                           tool_choice={"type": "tool", "name": "get_weather"})
    grammar = fake.requests[-1]["params"].structured_outputs.grammar
    assert grammar.startswith('start: "<tool_call>"')  # a named tool: the reply is that call
    client.messages.create(model="fake-model", max_tokens=100, tools=WEATHER, messages=ask,
                           tool_choice={"type": "none"})
    assert fake.requests[-1]["params"].structured_outputs is None


def test_the_stream_carries_what_the_whole_message_does(scripted):
    fake, _, client = scripted("One moment.\n" + CALL, "One moment.\n" + CALL)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.messages.create(model="fake-model", max_tokens=100, tools=WEATHER, messages=ask)
    with client.messages.stream(model="fake-model", max_tokens=100, tools=WEATHER, messages=ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds and kinds.count("content_block_start") == 2 == kinds.count("content_block_stop")
    assert without_ids(final.content) == without_ids(whole.content)  # each call gets its own id
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens


def test_text_streams_in_pieces(scripted):
    fake, http, _ = scripted("Your parcel ships today.")
    with http.stream("POST", "/v1/messages", json={"max_tokens": 50, "stream": True,
                                                   "messages": [{"role": "user", "content": "Where?"}]}) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines[1::2]]
    assert all(name == f"event: {e['type']}" for name, e in zip(lines[0::2], events))
    pieces = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert len(pieces) > 1 and "".join(pieces) == "Your parcel ships today."
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_json_outputs_constrain_the_reply(scripted):
    fake, _, client = scripted('{"n": 1}')
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    m = client.messages.create(model="fake-model", max_tokens=20, messages=[{"role": "user", "content": "a number"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert fake.requests[-1]["params"].structured_outputs.json == schema and json.loads(m.content[0].text) == {"n": 1}


def test_count_tokens_counts_the_rendered_prompt(scripted):
    fake, _, client = scripted()
    counted = client.messages.count_tokens(model="fake-model", system="Be brief.", tools=WEATHER,
                                           messages=[{"role": "user", "content": "Where?"}])
    m = client.messages.create(model="fake-model", max_tokens=5, system="Be brief.", tools=WEATHER,
                               messages=[{"role": "user", "content": "Where?"}])
    assert counted.input_tokens == len(fake.requests[-1]["prompt"]) and m.usage.input_tokens > 0


def test_keys_are_read_from_x_api_key(smol_tokenizer):
    keys = Credentials(keys={"sk-alice-01": "alice"})
    http = TestClient(create_app(FakeEngineClient(smol_tokenizer), credentials=keys))
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert http.post("/v1/messages", json=body, headers={"x-api-key": "sk-alice-01"}).status_code == 200
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    client = anthropic.Anthropic(base_url="http://testserver", api_key="wrong", http_client=http, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model="fake-model", **body)


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "`system`"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "ok"}]}]}, "answers no tool_use"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024}}, "think"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]}, "maximum context length"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "model": "claude-opus"}, "does not exist"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []}, "mcp_servers"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}}, "reason"),
])
def test_bad_requests_are_refused_in_anthropics_shape(scripted, body, words):
    fake, http, _ = scripted()
    r = http.post("/v1/messages", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["type"] == "error" and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert fake.requests == []
    assert http.post("/v1/chat/completions", json={"messages": []}).json()["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_refused_in_anthropics_shape(smol_tokenizer):
    http = TestClient(create_app(FakeEngineClient(smol_tokenizer), max_request_bytes=2000))
    r = http.post("/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert "limit of 2000 bytes" in r.json()["error"]["message"]


def test_a_last_assistant_turn_is_continued(scripted):
    fake, _, client = scripted(" NW20481377.")
    ask = [{"role": "user", "content": "Which order?"}, {"role": "assistant", "content": "Your order is"}]
    m = client.messages.create(model="fake-model", max_tokens=10, messages=ask)
    prompt = prompt_of(fake)
    assert prompt.endswith("Your order is") and prompt.count("<|im_start|>assistant") == 1
    assert m.content[0].text == " NW20481377."
