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
