"""Scale-out shape: a UI tier (`app.py --engine-url`) talking to an engine pod over the OpenAI API;
request ids echoed and logged as structured lines."""
import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AuthenticationError

from app import build_app, parse_args
from engine import EngineConfig
from engine.async_llm import AsyncLLM
from storage import Store
from tests.serving import LiveServer, logins_file

LEFT_AS_IS = {"__type__": "update"}  # /send's box output when the message was sent (refused: the text)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine_pod(tiny_model):
    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=128))
    with LiveServer(llm) as server:
        server.model_path = path
        yield server


@pytest.mark.slow
def test_ui_tier_chats_through_the_engine_pod(engine_pod, tmp_path):
    db = str(tmp_path / "ui.db")
    app, llm = build_app(parse_args(["--demo", "--db", db, "--model", engine_pod.model_path,
                                     "--engine-url", f"{engine_pod.url}/v1",
                                     "--auth-file", logins_file(tmp_path, carol="pw-c")]))
    with LiveServer(llm, app) as ui:
        assert httpx.get(f"{ui.url}/health").status_code == 200
        client = Client(ui.url, auth=("carol", "pw-c"), verbose=False)
        chat, box = client.predict("hello there", 0.0, 1.0, 16, api_name="/send")
        assert box == LEFT_AS_IS and "generated" in str(chat[-1]["content"])
        store = Store(db)
        sid = store.sessions("login:carol")[0]["id"]
        reply = store.messages("login:carol", sid)[-1]
        assert reply["generated_tokens"] == len(reply["token_ids"]) == 16
        stats = engine_pod.llm.run_on_engine_thread(lambda e: e.get_stats())
        assert stats.generation_tokens_total >= 16 and stats.kv_blocks_used == 0
        # the second turn's prompt starts with the first turn's exact ids: a prefix-cache hit on the pod
        client.predict("and again", 0.0, 1.0, 16, api_name="/send")
        assert store.messages("login:carol", sid)[-1]["cached_tokens"] >= 16


@pytest.mark.slow
def test_api_keys_guard_the_pages_own_api_too(engine_pod, tmp_path):
    """With keys and no logins, the chat page asks for a login (the key's name and the key): its
    Gradio endpoints reach the engine, so they are guarded like /v1."""
    keys = tmp_path / "keys.txt"
    keys.write_text("shop:sk-shop-123456\n")
    app, llm = build_app(parse_args(["--demo", "--db", str(tmp_path / "ui.db"), "--model", engine_pod.model_path,
                                     "--engine-url", f"{engine_pod.url}/v1", "--api-key-file", str(keys)]))
    with LiveServer(llm, app) as ui:
        with pytest.raises(AuthenticationError):
            Client(ui.url, verbose=False).predict("hello", 0.0, 1.0, 16, api_name="/send")
        direct = httpx.post(f"{ui.url}/gradio_api/call/send", json={"data": ["hello", 0.0, 1.0, 16]})
        assert direct.status_code in (401, 403), direct.text
        with pytest.raises(ValueError, match="Could not login"):
            Client(ui.url, auth=("shop", "wrong-key"), verbose=False)
        chat, _ = Client(ui.url, auth=("shop", "sk-shop-123456"), verbose=False).predict(
            "hello", 0.0, 1.0, 16, api_name="/send")
        assert "generated" in str(chat[-1]["content"])
        assert httpx.post(f"{ui.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        ok = httpx.post(f"{ui.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                        headers={"Authorization": "Bearer sk-shop-123456"})
        assert ok.status_code == 200


def test_request_id_is_echoed_and_logged_without_text(engine_pod, caplog):
    caplog.set_level(logging.INFO, logger="pagedchat.requests")
    r = httpx.post(f"{engine_pod.url}/v1/completions", headers={"X-Request-Id": "trace-42", "X-Session-Id": "s9"},
                   json={"prompt": "secret order details", "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert len(r.json()["choices"][0]["token_ids"]) == 3
    records = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "pagedchat.requests"]
    mine = [rec for rec in records if rec["request_id"] == "trace-42"]
    assert mine and mine[0]["session"] == "s9" and mine[0]["completion_tokens"] == 3
    assert mine[0]["ttft_s"] is not None and mine[0]["finish_reason"] == "length"
    assert "secret" not in json.dumps(mine[0])
    generated = httpx.post(f"{engine_pod.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert generated.headers["x-request-id"].startswith("req-")


def test_ui_tier_starts_without_torch(engine_pod, tmp_path):
    """A UI pod needs the tokenizer, not the engine: with torch unimportable it builds and connects."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "from app import build_app, parse_args\n"
        f"app, client = build_app(parse_args(['--demo', '--db', {str(tmp_path / 'ui.db')!r}, '--model', "
        f"{engine_pod.model_path!r}, '--engine-url', {engine_pod.url + '/v1'!r}]))\n"
        "assert client.wait_ready(120), client.error\n"
        "print('serving', client.info.name, client.info.max_model_len)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"serving {os.path.basename(engine_pod.model_path)} 512" in result.stdout
