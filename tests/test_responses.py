"""Fast tier: /v1/responses against a fake EngineClient, through the official `openai` client where a
program would use it: the prompt a request renders, the response object and its event stream (each
event read back as the client's own types), conversations continued by previous_response_id, the
stored responses' routes, and the refusals."""
import json

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent

from engine.tools import call_text
from server.auth import Credentials
from server.routes import create_app
from tests.fakes import FakeEngineClient, serving_replies

WEATHER = [{"type": "function", "name": "get_weather", "description": "Today's weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = call_text("get_weather", {"city": "Paris"})
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def scripted(smol_tokenizer):
    def make(*replies: str):
        fake, http = serving_replies(smol_tokenizer, *replies)
        return fake, http, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    return make


def rendered(fake, messages: list[dict]) -> str:
    tok = fake.info.tokenizer
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_of(fake, n: int = -1) -> str:
    return fake.info.tokenizer.decode(fake.requests[n]["prompt"])


def stream_events(http, body: dict) -> list[dict]:
    """The raw events, each checked against the client's event types and its `event:` line."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names, events = lines[0::2], [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    for name, event in zip(names, events):
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_string_input_is_one_user_message_and_the_response_validates(scripted):
    fake, http, client = scripted("Your parcel ships today.")
    r = client.responses.create(model="fake-model", input="Where is my parcel?", instructions="Be brief.",
                                max_output_tokens=50, temperature=0.3, metadata={"ticket": "T-1"})
    assert prompt_of(fake) == rendered(fake, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Where is my parcel?"}])
    params = fake.requests[-1]["params"]
    assert params.max_tokens == 50 and params.temperature == 0.3 and fake.requests[-1]["request_id"] == r.id
    body = http.get(f"/v1/responses/{r.id}").json()
    Response.model_validate(body)  # every field the client's type requires, in its type
    assert r.output_text == "Your parcel ships today." and r.status == "completed" and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(fake.requests[-1]["prompt"]) and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.metadata == {"ticket": "T-1"} and r.temperature == 0.3


def test_previous_response_id_continues_the_conversation_without_its_instructions(scripted):
    fake, _, client = scripted("It ships today.", "On Monday.")
    first = client.responses.create(model="fake-model", input="Where is my parcel?", instructions="Be brief.")
    second = client.responses.create(model="fake-model", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "And the tent?"}]}], previous_response_id=first.id)
    assert prompt_of(fake) == rendered(fake, [{"role": "user", "content": "Where is my parcel?"},
                                              {"role": "assistant", "content": "It ships today."},
                                              {"role": "user", "content": "And the tent?"}])
    assert second.previous_response_id == first.id and second.output_text == "On Monday."
    third = client.responses.create(model="fake-model", input="Thanks", previous_response_id=second.id)
    assert prompt_of(fake).count("<|im_start|>assistant") == 3 and third.status == "completed"
    # a stateless client resends the output items itself: the same prompt
    client.responses.create(model="fake-model", input=[{"role": "user", "content": "Where is my parcel?"},
                                                       *[o.model_dump() for o in first.output],
                                                       {"role": "user", "content": "And the tent?"}], store=False)
    assert fake.requests[-1]["prompt"] == fake.requests[1]["prompt"]


def test_a_function_call_and_its_output_round_trip(scripted):
    fake, _, client = scripted("Let me check.\n" + CALL, "It is sunny in Paris.")
    r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=WEATHER)
    assert fake.requests[-1]["params"].structured_outputs.grammar  # the call is held to the schema
    assert "get_weather" in prompt_of(fake)
    message, call = r.output
    assert message.type == "message" and r.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"} and call.call_id.startswith("call_") and call.status == "completed"
    answer = client.responses.create(model="fake-model", previous_response_id=r.id, tools=WEATHER, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert answer.output_text == "It is sunny in Paris."
    prompt = prompt_of(fake)
    assert prompt.index("Weather in Paris?") < prompt.index('"city": "Paris"') < prompt.index("sunny, 21C")
    named = client.responses.create(model="fake-model", input="Weather?", tools=WEATHER,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert "get_weather" in fake.requests[-1]["params"].structured_outputs.grammar and named.tool_choice.name == \
        "get_weather"


def test_the_stream_builds_what_the_whole_response_is(scripted):
    fake, http, client = scripted("Your parcel ships today.", "Your parcel ships today.")
    whole = client.responses.create(model="fake-model", input="Where?")
    events = stream_events(http, {"model": "fake-model", "input": "Where?"})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == whole.output_text and final["status"] == "completed"
    assert final["output"][0]["id"] == events[2]["item"]["id"] == events[-2]["item"]["id"]
    assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_the_openai_stream_helper_reassembles_text_and_calls(scripted):
    fake, _, client = scripted("One moment.\n" + CALL)
    with client.responses.stream(model="fake-model", input="Weather in Paris?", tools=WEATHER) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    message, call = final.output
    assert message.content[0].text == "One moment." and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_max_output_tokens_makes_an_incomplete_response(scripted):
    fake, http, client = scripted("Your parcel ships today, by courier.", "Your parcel ships today, by courier.")
    r = client.responses.create(model="fake-model", input="Where?", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    events = stream_events(http, {"model": "fake-model", "input": "Where?", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


def test_logprobs_come_when_included(scripted):
    fake, _, client = scripted("Yes.", "Yes.")
    r = client.responses.create(model="fake-model", input="?", top_logprobs=2,
                                include=["message.output_text.logprobs"])
    scores = r.output[0].content[0].logprobs
    assert len(scores) == r.usage.output_tokens
    assert scores[0].logprob == -0.25 and len(scores[0].top_logprobs) == 2
    r = client.responses.create(model="fake-model", input="?")
    assert fake.requests[-1]["params"].logprobs is None and r.output[0].content[0].logprobs is None


def test_json_schema_text_format_constrains_the_reply(scripted):
    fake, _, client = scripted('{"n": 1}')
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.responses.create(model="fake-model", input="a number",
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert fake.requests[-1]["params"].structured_outputs.json == schema
    assert r.text.format.type == "json_schema" and json.loads(r.output_text) == {"n": 1}


def test_stored_responses_retrieve_delete_and_list_their_input(scripted):
    fake, http, client = scripted()
    items = [{"role": "user", "content": f"line {i}"} for i in range(5)]
    r = client.responses.create(model="fake-model", input=items)
    page = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["line 4", "line 3"] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[0].id)
    assert rest.data == [] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc").data] == [
        f"line {i}" for i in range(5)]
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.create(
            model="fake-model", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError, match=r.id):
            call()
    unstored = client.responses.create(model="fake-model", input="x", store=False)
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.retrieve(unstored.id)
    assert http.put("/v1/responses").status_code == 405


def test_a_response_is_read_only_with_the_key_that_made_it(smol_tokenizer):
    keys = Credentials(keys={"sk-alice-0001": "alice", "sk-bob-00002": "bob"})
    http = TestClient(create_app(FakeEngineClient(smol_tokenizer), credentials=keys))
    made = http.post("/v1/responses", json={"input": "hi"}, headers={"Authorization": "Bearer sk-alice-0001"})
    rid = made.json()["id"]
    assert http.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer sk-alice-0001"}).status_code == 200
    assert http.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer sk-bob-00002"}).status_code == 404
    assert http.get(f"/v1/responses/{rid}").status_code == 401


def test_the_store_keeps_the_newest(scripted):
    fake, http, client = scripted()
    http.app.state.responses.keep = 2
    ids = [client.responses.create(model="fake-model", input=f"q{i}").id for i in range(3)]
    assert http.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert all(http.get(f"/v1/responses/{rid}").status_code == 200 for rid in ids[1:])


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]", "text only"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "ok"}]}, "input[0].call_id",
     "answers no function call"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "must be user"),
    ({"input": []}, "input", "empty"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature"),
    ({"input": "x", "max_output_tokens": 100000}, "max_tokens", "maximum context length"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"input": "x", "previous_response_id": "resp_nothing"}, "previous_response_id", "not found"),
    ({"input": 5}, "input", "valid string"),  # no union branch tag ("input.str") in the name
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "needs `schema`"),
    ({"input": "x", "n": 2}, "n", "one output"),
])
def test_bad_requests_are_refused_by_name(scripted, body, param, words):
    fake, http, _ = scripted()
    r = http.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert fake.requests == []


def test_an_engine_failure_mid_stream_ends_in_response_failed(scripted):
    fake, http, _ = scripted("Your parcel ships today, by courier.")
    fake.die_after = 2
    with http.stream("POST", "/v1/responses", json={"input": "Where?", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "went away" in events[-1]["message"]
    assert not any(e["type"] == "response.completed" for e in events)
