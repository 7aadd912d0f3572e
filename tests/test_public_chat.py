"""`--public-chat`: with staff logins (an operator, an agent), customers still chat without one, each
browser a visitor known by the server-signed cookie; the console, the demo page and /v1 keep asking
for a login or key. Without the flag, once a login exists, the chat asks for one too."""
import httpx
import pytest
from gradio_client import Client

from app import build_app, parse_args
from server.auth import VISITOR_COOKIE
from storage import Store
from tests.serving import LiveServer, logins_file

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def shop(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("public")
    db = str(folder / "chat.db")
    args = parse_args(["--db", db, "--model", tiny_chat_model, "--dtype", "float32", "--num-kv-blocks", "256",
                       "--auth-file", logins_file(folder, alice="pw-alice-1", bo="pw-bo-123"), "--admin", "alice",
                       "--agent", "bo", "--public-chat"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


def test_a_customer_chats_without_a_login_as_a_visitor(shop):
    page = httpx.get(shop.url + "/chat/support/")
    assert page.status_code == 200 and VISITOR_COOKIE in page.cookies
    assert httpx.get(shop.url + "/chat/support/config", cookies=page.cookies).status_code == 200
    client = Client(shop.url + "/chat/support/", verbose=False)
    client.predict("Do you ship to Canada?", api_name="/send")
    with Store(shop.db)._db() as db:
        users = [r[0] for r in db.execute("select user_id from sessions s where exists "
                                          "(select 1 from messages m where m.session_id = s.id)")]
    assert users and all(u.startswith("visitor:") for u in users)


def test_the_staffs_pages_and_the_api_still_ask_for_a_login_or_key(shop):
    assert httpx.get(shop.url + "/console/config").status_code == 401
    assert httpx.get(shop.url + "/v1/models").status_code == 401
    staff = httpx.Client(base_url=shop.url)
    assert staff.post("/console/login", data={"username": "bo", "password": "pw-bo-123"}).status_code == 200
    assert staff.get("/console/config").status_code == 200
    with pytest.raises(Exception):
        Client(shop.url + "/console/", verbose=False)  # no login, no console


def test_a_visitor_can_ask_for_a_person(shop):
    """Agents are configured, so the anonymous customer is offered one and lands in the inbox."""
    client = Client(shop.url + "/chat/support/", verbose=False)
    client.predict("I want to talk to a person", api_name="/send")
    with Store(shop.db)._db() as db:
        waiting = [r[0] for r in db.execute("select user_id from sessions where state = 'waiting'")]
    assert waiting and waiting[0].startswith("visitor:")


def test_without_the_flag_a_login_guards_the_chat(tiny_chat_model, tmp_path):
    args = parse_args(["--db", str(tmp_path / "chat.db"), "--model", tiny_chat_model, "--dtype", "float32",
                       "--num-kv-blocks", "64", "--auth-file", logins_file(tmp_path, alice="pw-alice-1"),
                       "--admin", "alice"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        assert httpx.get(server.url + "/chat/support/config").status_code == 401
        assert VISITOR_COOKIE not in httpx.get(server.url + "/chat/support/").cookies
