"""Fast tier: `--handoff-webhook-file`. A chat that begins to wait for a person (the button, the words,
the handoff tool) is announced once to the webhook, in Slack's and Discord's fields, naming the chat,
the customer and their last words; a webhook that fails or is slow costs the chat nothing."""
import asyncio
import json
import logging
import queue
from types import SimpleNamespace

import pytest

from storage import Store
from tests.fakes import FakeEngineClient
from tests.serving import local_site
from ui.handlers import ChatHandlers
from ui.notify import HandoffWebhook, read_webhook


def customer(name: str):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}", headers={},
                           request=SimpleNamespace(path_params={"assistant": "support"}))


async def _drain(gen):
    return [u async for u in gen]


@pytest.fixture
def posted():
    """A webhook that records each POSTed JSON body (answered 200, or what `status` says)."""
    bodies: queue.Queue = queue.Queue()
    status = {"code": 200}

    def answer(handler):
        length = int(handler.headers.get("Content-Length") or 0)
        bodies.put((handler.command, handler.headers.get("Content-Type"), json.loads(handler.rfile.read(length))))
        handler.send_response(status["code"])
        handler.end_headers()
    with local_site(answer) as url:
        yield SimpleNamespace(url=url + "/hooks/abc", bodies=bodies, status=status)


def shop_with(url, smol_tokenizer, tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    hook = HandoffWebhook(url, store)
    chat = ChatHandlers(FakeEngineClient(smol_tokenizer, max_model_len=1024), store, demo=False, on_waiting=hook)
    return chat, hook


def send(chat, who: str, text: str):
    uid, sid = chat.current(None, None, customer(who))
    asyncio.run(_drain(chat.send(uid, sid, text, request=customer(who))))
    return uid, sid


def test_a_chat_that_begins_to_wait_is_announced_once(posted, smol_tokenizer, tmp_path):
    chat, hook = shop_with(posted.url, smol_tokenizer, tmp_path)
    _, sid = send(chat, "cara", "My tent arrived torn, card 4111 1111 1111 1111. Talk to a person please")
    method, kind, body = posted.bodies.get(timeout=10)
    assert (method, kind) == ("POST", "application/json")
    assert body["chat"] == sid and body["customer"] == "login:cara" and body["waiting"] == 1
    assert body["text"] == body["content"] and "My tent arrived torn" in body["text"]
    assert "4111 1111 1111 1111" not in body["text"] and "•••• 1111" in body["message"]  # masked before it is stored
    send(chat, "cara", "Hello? Anyone?")  # still waiting: not announced again
    hook.queue.join()
    assert posted.bodies.empty() and hook.sent == 1
    uid2, sid2 = chat.current(None, None, customer("dan"))
    chat.ask_person(uid2, sid2, customer("dan"))  # the button
    assert posted.bodies.get(timeout=10)[2]["waiting"] == 2


def test_a_failing_webhook_is_logged_and_the_chat_still_waits(posted, smol_tokenizer, tmp_path, caplog):
    posted.status["code"] = 500
    chat, hook = shop_with(posted.url, smol_tokenizer, tmp_path)
    with caplog.at_level(logging.WARNING, "pagedchat.notify"):
        _, sid = send(chat, "eve", "talk to a person")
        hook.queue.join()
    assert hook.failed == 1 and "could not announce chat" in caplog.text and "500" in caplog.text
    assert chat.handoff.state(sid)["state"] == "waiting"


def test_an_unreachable_webhook_is_the_same(smol_tokenizer, tmp_path, caplog):
    chat, hook = shop_with("http://127.0.0.1:9/nothing-listens", smol_tokenizer, tmp_path)
    with caplog.at_level(logging.WARNING, "pagedchat.notify"):
        _, sid = send(chat, "fay", "talk to a person")
        hook.queue.join()
    assert hook.failed == 1 and chat.handoff.state(sid)["state"] == "waiting"


def test_the_url_comes_from_a_file(tmp_path):
    path = tmp_path / "hook"
    path.write_text("https://hooks.slack.com/services/T000/B000/XXXX\n")
    assert read_webhook(str(path)) == "https://hooks.slack.com/services/T000/B000/XXXX"
    path.write_text("file:///etc/passwd")
    with pytest.raises(ValueError, match="must hold an http"):
        read_webhook(str(path))
