"""Fast tier: the HTTP routes against a fake EngineClient (no model): response and error shapes,
streaming framing, what the engine is asked for."""
import json

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from engine.client import EngineDeadError, EngineOverloadedError
from server.auth import Credentials
from server.routes import create_app
from tests.fakes import FakeEngineClient

HELLO = [{"role": "user", "content": "Where is my parcel?"}]


@pytest.fixture
def fake(smol_tokenizer):
    return FakeEngineClient(smol_tokenizer)


@pytest.fixture
def http(fake):
    return TestClient(create_app(fake))


def test_chat_completion_renders_the_template_and_reports_usage(fake, http, smol_tokenizer):
    r = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": HELLO, "max_tokens": 50},
                  headers={"X-Session-Id": "chat-7"})
    assert r.status_code == 200, r.text
    body = r.json()
    asked = fake.requests[-1]
    expected_prompt = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(
        HELLO, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert asked["prompt"] == expected_prompt and asked["session_id"] == "chat-7"
    assert asked["params"].max_tokens == 50 and asked["request_id"] == body["id"]
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " Your parcel ships today."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
    assert body["usage"]["completion_tokens"] == len(fake.reply_ids)


def test_a_reply_may_continue_the_last_assistant_message(fake, http, smol_tokenizer):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (a prefill), no end of
    turn and no new turn after it; the template's own switches come through chat_template_kwargs."""
    prefill = HELLO + [{"role": "assistant", "content": "Your order NW"}]
    r = http.post("/v1/chat/completions", json={"messages": prefill, "continue_final_message": True,
                                                "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    text = smol_tokenizer.decode(fake.requests[-1]["prompt"])
    assert text.endswith("<|im_start|>assistant\nYour order NW"), text[-60:]
    http.post("/v1/chat/completions", json={"messages": prefill})  # by default the message is closed, a turn opened
    assert smol_tokenizer.decode(fake.requests[-1]["prompt"]).endswith("Your order NW<|im_end|>\n<|im_start|>assistant\n")
    http.post("/v1/chat/completions", json={"messages": HELLO, "add_generation_prompt": False})
    assert smol_tokenizer.decode(fake.requests[-1]["prompt"]).endswith("Where is my parcel?<|im_end|>\n")
    for body, says in (({"messages": prefill, "continue_final_message": True}, "add_generation_prompt"),
                       ({"messages": HELLO, "continue_final_message": True, "add_generation_prompt": False},
                        "assistant's"),
                       ({"messages": HELLO, "chat_template_kwargs": {"tokenize": True}}, "tokenize")):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_a_part_that_is_not_text_is_refused_by_name(http):
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    r = http.post("/v1/chat/completions", json={"messages": image})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content.1"  # the part, no union branch tags
    assert error["message"] == ("messages.0.content.1: this model reads text only; a content part of type "
                                "'image_url' cannot be read")  # not also "should be a valid string"
    r = http.post("/v1/chat/completions", json={"messages": HELLO, "stop": 5})
    assert r.json()["error"]["message"] == "stop: Input should be a valid string; stop: Input should be a valid list"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "it?"}]}]
    assert http.post("/v1/chat/completions", json={"messages": parts}).status_code == 200


def test_max_tokens_defaults_to_the_room_left(fake, http):
    http.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert fake.requests[-1]["params"].max_tokens == fake.info.max_model_len - 3


def test_stream_framing_role_deltas_finish_usage_done(http, fake):
    with http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "stream": True, "max_tokens": 3,
                                                           "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[1:-2]]
    assert "".join(deltas) == fake.info.tokenizer.decode(fake.reply_ids[:3])
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["choices"][0]["delta"] == {}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert len({e["id"] for e in events}) == 1


def test_completions_echo_token_ids_and_several_prompts(http, fake):
    r = http.post("/v1/completions", json={"prompt": ["Hello", "Bye"], "max_tokens": 2, "echo": True,
                                           "return_token_ids": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"].startswith("Hello") and choices[1]["text"].startswith("Bye")
    assert choices[0]["token_ids"] == fake.reply_ids[:2]


@pytest.mark.parametrize("refusal, status, code", [
    (EngineOverloadedError("engine overloaded: 9 waiting"), 503, "overloaded"),
    (EngineDeadError("engine loop crashed"), 503, None),
    (ValueError("temperature must be a number >= 0, got -1."), 400, None),
])
def test_engine_refusals_become_openai_errors(fake, http, refusal, status, code):
    fake.refuse_with = refusal
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"messages": HELLO, "stream": stream})
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
        assert str(refusal) in error["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "refund " * 600}]}, "messages"),
    ("/v1/completions", {"prompt": list(range(1, 600))}, "prompt"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HELLO, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": HELLO, "seed": 2**70}, "seed"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": float("inf")}, "temperature"),
])
def test_bad_requests_name_the_field(http, path, body, param):
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_tokenize_counts_what_a_chat_request_would_send(fake, http, smol_tokenizer):
    """vLLM's /tokenize of messages: tools and the template switches render as in /v1/chat/completions."""
    order = {"type": "object", "properties": {"order": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "track", "description": "Track an order", "parameters": order}}]
    prefill = HELLO + [{"role": "assistant", "content": "Your order NW"}]
    continued = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    for extra in ({}, {"tools": tools}, continued):
        body = {"messages": HELLO, **extra}
        assert http.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200
        counted = http.post("/tokenize", json={**body, "return_token_strs": True}).json()
        assert counted["tokens"] == fake.requests[-1]["prompt"] and counted["count"] == len(counted["tokens"])
        assert counted["token_strs"] == smol_tokenizer.convert_ids_to_tokens(counted["tokens"])
    assert "token_strs" not in http.post("/tokenize", json={"prompt": "hi"}).json()
    r = http.post("/tokenize", json={"messages": HELLO, "tools": [{"type": "function", "function": {}}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools")
    assert http.post("/tokenize", json={"messages": []}).json()["error"]["param"] == "messages"


def test_unknown_model_loading_engine_and_api_key(fake, smol_tokenizer):
    http = TestClient(create_app(fake, credentials=Credentials(keys={"k-123456": "shop"}),
                                 served_model_name="support-bot"))
    assert http.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 401
    auth = {"Authorization": "Bearer k-123456"}
    assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == "support-bot"
    r = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": HELLO}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/metrics").text.startswith("# fake\n")  # public: no key needed
    fake.state, fake.error = "loading", "the model is still loading"
    assert http.get("/health").status_code == 503
    r = http.post("/v1/chat/completions", json={"messages": HELLO}, headers=auth)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]


def test_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "abc"})
    assert r.headers["x-request-id"] == "abc"
    assert http.get("/health").headers["x-request-id"].startswith("req-")


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(fake, smol_tokenizer):
    import dataclasses

    fake.info = dataclasses.replace(fake.info, sampling_defaults={"temperature": 0.2, "top_p": 0.9})
    http = TestClient(create_app(fake))
    http.post("/v1/chat/completions", json={"messages": HELLO})
    assert (fake.requests[-1]["params"].temperature, fake.requests[-1]["params"].top_p) == (0.2, 0.9)
    http.post("/v1/chat/completions", json={"messages": HELLO, "temperature": 1.0, "top_p": 0.5})
    assert (fake.requests[-1]["params"].temperature, fake.requests[-1]["params"].top_p) == (1.0, 0.5)


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "functions", [{"name": "refund"}]),
    ("/v1/chat/completions", "function_call", "auto"), ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "suffix", "!"), ("/v1/completions", "best_of", 3),
    ("/v1/chat/completions", "modalities", ["text", "audio"]), ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
])
def test_fields_not_implemented_are_refused_by_name(http, fake, path, field, value):
    body = {"messages": HELLO} if "chat" in path else {"prompt": "Hi"}
    r = http.post(path, json={**body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    assert http.post(path, json={**body, "logprobs": False, "response_format": {"type": "text"}, "tools": [],
                                 "max_tokens": 2} if "chat" in path else {**body, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("page_behind", [False, True])
def test_malformed_bodies_and_unknown_routes_answer_in_openai_shape(fake, page_behind):
    app = create_app(fake)
    if page_behind:  # as in app.py, where the chat page is mounted at / behind the API
        app.mount("/", lambda scope, receive, send: JSONResponse({"detail": "Not Found"}, 404)(scope, receive, send))
    http = TestClient(app)
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=b'\xff\xfe{"a"', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/chat/completions", content=b'{"messages": "\xff"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "must be UTF-8 text" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=json.dumps({"messages": HELLO}), headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        r = http.request(method, path)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_a_body_over_the_limit_is_refused_before_parsing(fake):
    http = TestClient(create_app(fake, max_request_bytes=2000))
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert fake.requests == []
    assert http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_503_says_when_to_retry(fake, http):
    fake.refuse_with = EngineOverloadedError("engine overloaded")
    assert http.post("/v1/completions", json={"prompt": "Hi"}).headers["retry-after"] == "1"
    fake.refuse_with, fake.state = None, "loading"
    assert http.post("/v1/completions", json={"prompt": "Hi"}).headers["retry-after"] == "5"


def test_chat_logprobs_in_openai_shape_whole_and_streamed(http, fake):
    body = {"messages": HELLO, "logprobs": True, "top_logprobs": 2}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(fake.reply_ids) and "".join(c["token"] for c in content) == choice["message"]["content"]
    assert all(c["logprob"] == -0.25 and len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
               for c in content)
    assert fake.requests[-1]["params"].logprobs == 2
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = [c for ch in chunks for c in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == content
    plain = http.post("/v1/chat/completions", json={"messages": HELLO}).json()["choices"][0]
    assert plain["logprobs"] is None and fake.requests[-1]["params"].logprobs is None


def test_completion_logprobs_with_echo_score_the_prompt_too(http, fake, smol_tokenizer):
    r = http.post("/v1/completions", json={"prompt": "Where is my parcel?", "logprobs": 1, "echo": True}).json()
    choice = r["choices"][0]
    prompt_ids = smol_tokenizer.encode("Where is my parcel?")
    scores = choice["logprobs"]
    assert len(scores["tokens"]) == len(prompt_ids) + len(fake.reply_ids)
    assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
    assert all(lp == -0.25 for lp in scores["token_logprobs"][1:])
    assert "".join(scores["tokens"]) == choice["text"]
    assert scores["text_offset"] == sorted(scores["text_offset"]) and scores["text_offset"][0] == 0
    assert fake.requests[-1]["params"].prompt_logprobs == 1
    r = http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    tokens = [t for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
              for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens) == "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    ({"structured_outputs": {"regex": "NW[0-9]{8}"}}, {"regex": "NW[0-9]{8}"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"response_format": {"type": "text"}}, None),
])
def test_structured_output_requests_reach_the_engine(http, fake, fields, expected):
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "Hi"})):
        assert http.post(path, json={**body, **fields}).status_code == 200
        spec = fake.requests[-1]["params"].structured_outputs
        assert (spec and {k: v for k, v in vars(spec).items() if v is not None}) == expected


def test_masks_reach_the_engine(http, fake):
    http.post("/v1/chat/completions", json={"messages": HELLO, "logit_bias": {"42": 150, "7": -3},
                                            "allowed_token_ids": [1, 2, 42], "bad_words": ["refund"]})
    params = fake.requests[-1]["params"]
    assert params.logit_bias == {42: 100.0, 7: -3.0} and params.allowed_token_ids == [1, 2, 42]
    assert params.bad_words == ["refund"]


def test_a_model_is_retrieved_by_its_name(http):
    card = http.get("/v1/models/fake-model").json()
    assert card["id"] == "fake-model" and card["object"] == "model" and card["max_model_len"] == 512
    for name in ("gpt-4o", ""):
        r = http.get(f"/v1/models/{name}")
        assert r.status_code == 404 and "`fake-model`" in r.json()["error"]["message"]


def test_api_requests_are_counted_by_route_template_and_status_class(http):
    from prometheus_client.parser import text_string_to_metric_families

    http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    with http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    http.post("/v1/chat/completions", json={"messages": []})
    http.get("/v1/responses/resp_x")
    http.get("/v1/nothing/at/all")
    http.get("/gradio_api/info")  # not the API's: not counted
    text = http.get("/metrics").text
    counts = {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
              for f in text_string_to_metric_families(text) for s in f.samples if s.name == "http_requests_total"}
    assert counts == {("/v1/chat/completions", "POST", "2xx"): 2, ("/v1/chat/completions", "POST", "4xx"): 1,
                      ("/v1/responses/{response_id}", "GET", "4xx"): 1, ("none", "GET", "4xx"): 1}
    timed = {s.labels["handler"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "http_request_duration_seconds_count"}
    assert timed == {"/v1/chat/completions": 3, "/v1/responses/{response_id}": 1, "none": 1}
    assert "# fake" in text  # the engine's own series are still there
