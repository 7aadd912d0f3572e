"""kill -9 in the middle of a streamed reply: what was written survives, is shown as interrupted,
and the chat goes on from it. The app runs as a real process, killed for real."""
import json
import os
import signal
import sqlite3
import subprocess

import pytest
from gradio_client import Client

from tests.serving import logins_file, start_process, wait_for

pytestmark = pytest.mark.e2e


def start_app(model: str, db: str) -> tuple[subprocess.Popen, str]:
    return start_process(["app.py", "--demo", "--model", model, "--dtype", "float32", "--num-kv-blocks", "512", "--db", db,
                          "--auth-file", logins_file(os.path.dirname(db), alice="pw-a")])


def rows(db: str, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


@pytest.mark.slow
def test_kill_9_mid_reply_keeps_it_and_the_chat_goes_on(tiny_chat_model, tmp_path):
    db = str(tmp_path / "chat.db")
    proc, url = start_app(tiny_chat_model, db)
    try:
        Client(url, auth=("alice", "pw-a"), verbose=False).submit(
            "Tell me a long story about a parcel.", 0.0, 1.0, 1024, api_name="/send")
        wait_for(lambda: rows(db, "select count(*) from messages where finish_reason = 'streaming' "
                                  "and generated_tokens >= 8")[0][0] == 1, 120, "part of the reply to be stored")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    (partial_ids,) = rows(db, "select token_ids from messages where role = 'assistant'")[0]
    proc, url = start_app(tiny_chat_model, db)
    try:
        assert rows(db, "select finish_reason from messages where role = 'assistant'") == [("interrupted",)]
        client = Client(url, auth=("alice", "pw-a"), verbose=False)
        chat, _ = client.predict("Are you still there?", 0.0, 1.0, 16, api_name="/send")
        assert "interrupted" in str(chat[1]["content"]) and "generated" in str(chat[-1]["content"])
        prompts = [json.loads(r[0]) for r in rows(db, "select token_ids from messages where role = 'user' order by id")]
        context = prompts[0] + json.loads(partial_ids)
        assert prompts[1][:len(context)] == context  # token-exact from what was written before the kill
    finally:
        proc.kill()  # graceful shutdown is not under test here
        proc.wait(30)


@pytest.mark.slow
def test_sigterm_drains_the_api_stream_ends_with_a_reason_the_chat_reply_is_kept_and_the_exit_is_0(
        tiny_chat_model, tmp_path):
    """SIGTERM with a streamed API reply and a chat reply in flight (both far from done): new requests
    are refused, both end within --drain-seconds (the stream with finish_reason "abort" and [DONE], the
    chat reply stored as interrupted, not left "streaming"), and the process exits 0."""
    import threading

    import httpx

    db = str(tmp_path / "chat.db")
    proc, url = start_process(["app.py", "--demo", "--model", tiny_chat_model, "--dtype", "float32",
                               "--num-kv-blocks", "512", "--db", db, "--drain-seconds", "2",
                               "--auth-file", logins_file(str(tmp_path), alice="pw-a"), "--api-key-file",
                               keys_file(tmp_path)])
    lines: list[str] = []
    try:
        body = {"model": os.path.basename(tiny_chat_model), "prompt": "Once upon a time", "max_tokens": 3000,
                "stream": True, "ignore_eos": True}

        def read_stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": "Bearer sk-test-00001"}) as r:
                lines.extend(line for line in r.iter_lines() if line)
        reader = threading.Thread(target=read_stream)
        reader.start()
        Client(url, auth=("alice", "pw-a"), verbose=False).submit(
            "Tell me a long story about a parcel.", 0.0, 1.0, 1024, api_name="/send")
        wait_for(lambda: rows(db, "select count(*) from messages where finish_reason = 'streaming'")[0][0] == 1
                 and len(lines) > 5, 120, "both replies under way")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(30)
    finally:
        proc.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert rows(db, "select finish_reason from messages where role = 'assistant'") == [("interrupted",)]


def keys_file(folder) -> str:
    path = os.path.join(str(folder), "keys.txt")
    with open(path, "w") as f:
        f.write("tester:sk-test-00001\n")
    return path
