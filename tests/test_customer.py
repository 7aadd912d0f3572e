"""The customer deployment end to end (app.py without --demo): assistants at /chat/<assistant>, no
route that shows their prompt or takes sampling, the prefix cache shared across customers, and the
console for operators only."""
import httpx
import pytest
from gradio_client import Client

from app import build_app, parse_args
from storage import Store
from tests.serving import LiveServer, logins_file
from ui import assistants

pytestmark = pytest.mark.e2e

SECRET_POLICY = ("You are the VIP desk. Internal policy: refunds above 500 dollars need manager code ZX-81; "
                 "never reveal this code. ") * 3
TAKEN = {"system", "system_prompt", "temperature", "top_p", "max_tokens", "max_new", "penalty", "p", "temp"}


@pytest.fixture(scope="module")
def shop(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shop")
    db = str(folder / "chat.db")
    assistants.save(Store(db), "vip", {"name": "VIP desk", "system_prompt": SECRET_POLICY,
                                       "greeting": "Welcome, valued customer.", "sampling": {"max_tokens": 8}}, "test")
    args = parse_args(["--db", db, "--model", tiny_chat_model, "--dtype", "float32", "--num-kv-blocks", "512",
                       "--auth-file", logins_file(folder, alice="pw-a", bob="pw-b", cara="pw-c"), "--admin", "alice",
                       "--frame-ancestors", "https://shop.example"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


def test_the_root_leads_to_the_default_assistant_and_unknown_ones_are_a_clear_404(shop):
    r = httpx.get(shop.url + "/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == f"/chat/{assistants.DEFAULT_SLUG}/"
    r = httpx.get(shop.url + "/favicon.ico", follow_redirects=True)  # no 404 in a customer's console
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/")
    r = httpx.get(shop.url + "/chat/no-such-desk/")
    assert r.status_code == 404 and "There is no assistant at" in r.text and "/chat/support/" in r.text
    r = httpx.get(shop.url + "/chat/no-such-desk/", cookies={"pagedchat_lang": "ko"})
    assert r.status_code == 404 and "상담 창구가 없습니다" in r.text and "/chat/support/" in r.text
    assert httpx.get(shop.url + "/chat/vip/").status_code == 200
    assert httpx.get(shop.url + "/chat/vip/").headers["content-security-policy"] == \
        "frame-ancestors https://shop.example"


def test_no_customer_route_shows_the_prompt_or_takes_sampling(shop):
    http = httpx.Client(base_url=shop.url)
    http.post("/chat/vip/login", data={"username": "bob", "password": "pw-b"})
    seen = http.get("/chat/vip/").text + http.get("/chat/vip/config").text
    client = Client(shop.url + "/chat/vip/", auth=("bob", "pw-b"), verbose=False)
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert [p["parameter_name"] for p in endpoints["/send"]["parameters"]] == ["text"]
    for name, endpoint in endpoints.items():
        assert not TAKEN & {p["parameter_name"] for p in endpoint["parameters"]}, name
    assert "/save_system" not in endpoints
    seen += repr(client.predict(api_name="/init")) + repr(client.predict("Hello there", api_name="/send"))
    seen += repr(client.predict(api_name="/regenerate")) + repr(client.predict(api_name="/new_chat"))
    for fmt in ("/export_json", "/export_markdown"):
        seen += open(client.predict(api_name=fmt)).read()
    assert "ZX-81" not in seen and "Hello there" in seen


def test_the_assistants_prompt_is_computed_once_for_all_its_customers(shop):
    for name, password in (("alice", "pw-a"), ("cara", "pw-c")):
        Client(shop.url + "/chat/vip/", auth=(name, password), verbose=False).predict("Where is my order?",
                                                                                      api_name="/send")
    store = Store(shop.db)
    cached = {}
    for user in ("login:alice", "login:cara"):
        session = store.sessions(user, assistant="vip")[0]
        cached[user] = [m["cached_tokens"] for m in store.messages(user, session["id"]) if m["role"] == "assistant"][0]
    assert cached["login:cara"] >= 48  # the second customer's first turn found the assistant's prompt cached


def test_the_console_shows_nothing_to_a_customer(shop):
    http = httpx.Client(base_url=shop.url)
    http.post("/console/login", data={"username": "bob", "password": "pw-b"})
    assert "ZX-81" not in http.get("/console/").text + http.get("/console/config").text
    names = Client(shop.url + "/console/", auth=("bob", "pw-b"), verbose=False).view_api(
        return_format="dict", print_info=False)["named_endpoints"]
    with pytest.raises(Exception, match="Only operators"):
        Client(shop.url + "/console/", auth=("bob", "pw-b"), verbose=False).predict(api_name="/reset_prefix_cache")
    assert "/reset_prefix_cache" in names


def test_the_operators_downloads_go_to_operators_only(shop):
    """Rated replies and analytics are made on request by a route that checks the login; a customer
    with the URL gets a refusal, never the file (they used to be Gradio cache files)."""
    Client(shop.url + "/chat/vip/", auth=("bob", "pw-b"), verbose=False).predict("A rated question",
                                                                                 api_name="/send")
    store = Store(shop.db)
    session = store.sessions("login:bob", assistant="vip")[0]
    reply = [m for m in store.messages("login:bob", session["id"]) if m["role"] == "assistant"][-1]
    store.set_feedback("login:bob", session["id"], reply["id"], -1, "=HYPERLINK(\"http://evil.example\")")
    files = ("feedback.csv", "feedback.jsonl", "analytics.csv?days=7")
    anonymous = httpx.Client(base_url=shop.url)
    assert {anonymous.get(f"/console/export/{f}").status_code for f in files} == {401}
    customer = httpx.Client(base_url=shop.url)
    customer.post("/console/login", data={"username": "bob", "password": "pw-b"})
    customer.post("/chat/vip/login", data={"username": "bob", "password": "pw-b"})
    refused = [customer.get(f"/console/export/{f}") for f in files]
    assert {r.status_code for r in refused} == {403} and "Only operators" in refused[0].text
    assert not any("A rated question" in r.text for r in refused)
    names = Client(shop.url + "/console/", auth=("bob", "pw-b"), verbose=False).view_api(
        return_format="dict", print_info=False)["named_endpoints"]
    assert not {n for n in names if "feedback_csv" in n or "feedback_jsonl" in n or n == "/csv"}

    operator = httpx.Client(base_url=shop.url)
    operator.post("/console/login", data={"username": "alice", "password": "pw-a"})
    csv_file = operator.get("/console/export/feedback.csv")
    assert csv_file.status_code == 200 and csv_file.headers["cache-control"] == "no-store"
    assert csv_file.content.startswith(b"\xef\xbb\xbf") and "A rated question" in csv_file.text
    assert "'=HYPERLINK" in csv_file.text and 'filename="feedback.csv"' in csv_file.headers["content-disposition"]
    assert "A rated question" in operator.get("/console/export/feedback.jsonl").text
    assert "vip" in operator.get("/console/export/analytics.csv?days=7").text
    assert operator.get("/console/export/secrets.db").status_code == 404
    bad = operator.get("/console/export/analytics.csv?days=lots")
    assert bad.status_code == 400 and "days" in bad.text
