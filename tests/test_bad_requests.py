"""Fast tier: a table of bad requests across every route, each answered with the right status, in
OpenAI's error shape, naming the field; the server answers a good request right after each."""
import json

import pytest
from fastapi.testclient import TestClient

from server.routes import create_app
from tests.fakes import FakeEngineClient

HELLO = [{"role": "user", "content": "Where is my parcel?"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(**fields):
    return {"messages": HELLO, **fields}


def completion(**fields):
    return {"prompt": "Hello", **fields}


# (path, body or raw bytes, status, the param the error must name or None)
CASES = [
    # sampling values, on both endpoints
    *[(path, make(**{field: value}), 400, field)
      for path, make in ((CHAT, chat), (COMPLETIONS, completion))
      for field, value in (("temperature", -0.5), ("temperature", "hot"), ("temperature", float("inf")),
                           ("top_p", 0), ("top_p", 1.5), ("top_p", "all"), ("top_k", -2), ("top_k", 2.5),
                           ("min_p", 2), ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", "many"),
                           ("min_tokens", -1), ("seed", 2**70), ("seed", 1.5), ("presence_penalty", 3),
                           ("frequency_penalty", -3), ("repetition_penalty", 0), ("n", 0), ("n", 65), ("stop", [""]),
                           ("stop", 42), ("stop_token_ids", [-1]), ("stop_token_ids", "x"), ("priority", "high"),
                           ("stream", "maybe"), ("logprobs", 21), ("logit_bias", {"three": 10}),
                           ("logit_bias", {"3": float("nan")}), ("allowed_token_ids", []), ("bad_words", [""]),
                           ("structured_outputs", {"regex": "a", "choice": ["b"]}),
                           ("structured_outputs", {"json": "{nope"}), ("structured_outputs", {"xml": "<a/>"}),
                           ("response_format", {"type": "json_schema"}), ("response_format", {"type": "xml"}),
                           ("best_of", 2))],
    # chat-only shapes
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 42}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "tools[0].function.name"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0]"),
    (CHAT, chat(tools="lookup_order"), 400, "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), 400,
     "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]), 400, "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), 400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], response_format={"type": "json_object"}),
     400, "tools"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x",
                                                              "content": "{}"}]}, 400, "messages[1].tool_call_id"),
    (CHAT, chat(top_logprobs=5), 400, "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CHAT, chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), 400, "response_format"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_tokens"),
    (CHAT, chat(stream_options="yes"), 400, "stream_options"),
    (CHAT, {"messages": [{"role": "user", "content": "refund " * 600}]}, 400, "messages"),
    (CHAT, chat(max_tokens=100_000), 400, "max_tokens"),
    (CHAT, chat(model="gpt-9"), 404, "model"),
    # completion-only shapes
    (COMPLETIONS, {}, 400, "prompt"),
    (COMPLETIONS, {"prompt": 42}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "two"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": list(range(1, 600))}, 400, "prompt"),
    (COMPLETIONS, completion(suffix="!"), 400, "suffix"),
    (COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, 400, "prompt"),
    (COMPLETIONS, completion(model="davinci"), 404, "model"),
    # bodies that are not JSON objects
    (CHAT, b"{not json", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b"[1, 2, 3]", 400, None),
    (CHAT, b"\xff\xfe\x00garbage", 400, None),
    (COMPLETIONS, b'{"prompt": "unterminated', 400, None),
    # text that is not Unicode: a lone UTF-16 surrogate, which JSON can carry and no tokenizer encodes
    (CHAT, {"messages": [{"role": "user", "content": "ok \ud83d\ude00 then \udc00"}]}, 400, "messages[0].content"),
    (COMPLETIONS, completion(prompt="\ud800"), 400, "prompt"),
    (COMPLETIONS, completion(stop=["\ud800"]), 400, "stop[0]"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/responses", {"input": "\ud800"}, 400, "input"),
    # the tokenizer routes
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 42}, 400, "prompt"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", b"garbage", 400, None),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [-4]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", b"\x00\x01", 400, None),
]


@pytest.fixture(scope="module")
def http(smol_tokenizer):
    return TestClient(create_app(FakeEngineClient(smol_tokenizer)))


def test_the_table_is_large_enough():
    assert len(CASES) >= 80


@pytest.mark.parametrize("path, body, status, param", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_a_bad_request_gets_a_clear_error_and_the_server_goes_on(http, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) > 10
    if param is not None:
        assert error["param"] and error["param"].startswith(param), error
    good = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
