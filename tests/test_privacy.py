"""Fast tier: the console's customer data. An operator finds a customer by their id or the e-mail
address their shop signed them in with, downloads everything stored of them (an operator's download),
and erases it all: their chats and record go, overwritten in the file; nobody else's change."""
import json
from types import SimpleNamespace

import gradio as gr
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.auth import Credentials
from storage import Store
from ui import downloads
from ui.operator import OperatorHandlers
from ui.privacy import CustomerDataHandlers


@pytest.fixture
def shop(tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    store.ensure_user("customer:c-42", "Dana", "dana@example.com")
    for title, words in (("Tent", "DANASECRET my tent is torn"), ("Socks", "wool socks?")):
        sid = store.create_session("customer:c-42", title=title)
        store.add_message("customer:c-42", sid, "user", words, [1, 2])
        store.add_message("customer:c-42", sid, "assistant", "On it.", [3], tool_calls=[{"name": "lookup_order"}])
    other = store.create_session("visitor:abc")
    store.add_message("visitor:abc", other, "user", "OTHERCUSTOMER hello", [1])
    operator = OperatorHandlers(None, store, {}, None, {"alice"})
    return SimpleNamespace(store=store, data=CustomerDataHandlers(store, operator), path=str(tmp_path / "chat.db"),
                           other=other)


def op(name="alice"):
    return SimpleNamespace(username=name)


@pytest.mark.parametrize("who", ["customer:c-42", " DANA@example.com "])
def test_an_operator_finds_a_customer_by_id_or_e_mail(shop, who):
    summary, link, erase, confirm = shop.data.look_up(who, op())
    assert summary.startswith("**customer:c-42** (Dana, dana@example.com): 2 chat(s), 4 message(s), from ")
    assert "customer.json?who=customer%3Ac-42" in link and erase["visible"] and not confirm["visible"]
    assert "No customer 'nobody'" in shop.data.look_up("nobody", op())[0]


def test_only_operators_see_or_erase(shop):
    for call in (shop.data.look_up, shop.data.erase, shop.data.ask):
        with pytest.raises(gr.Error, match="Only operators"):
            call("customer:c-42", op("bo"))
    assert len(shop.store.sessions("customer:c-42")) == 2


def test_erasure_takes_all_of_one_customer_and_nothing_else(shop):
    assert shop.data.ask("dana@example.com", op())["visible"]
    line, *_ = shop.data.erase("dana@example.com", op())
    assert line.startswith("Deleted 2 chat(s) and 4 message(s) of **customer:c-42**")
    assert shop.store.sessions("customer:c-42") == [] and shop.data.look_up("customer:c-42", op())[0].startswith("No")
    assert [m["content"] for m in shop.store.messages("visitor:abc", shop.other)] == ["OTHERCUSTOMER hello"]
    data = open(shop.path, "rb").read()
    assert b"DANASECRET" not in data and b"OTHERCUSTOMER" in data


def test_the_download_is_everything_of_them_for_operators_only(shop):
    app = FastAPI()
    downloads.add_route(app, shop.store, Credentials(keys={"k-op": "alice", "k-bo": "bo"}, operators=frozenset({"alice"})))
    http = TestClient(app)
    url = "/console/export/customer.json?who=dana@example.com"
    got = http.get(url, headers={"Authorization": "Bearer k-op"})
    assert got.status_code == 200 and "attachment" in got.headers["content-disposition"]
    body = got.json()
    assert body["user"] == {"id": "customer:c-42", "name": "Dana", "email": "dana@example.com",
                            "created": body["user"]["created"]}
    assert [c["title"] for c in body["chats"]] == ["Tent", "Socks"]
    assert body["chats"][0]["messages"][1]["tool_calls"] == [{"name": "lookup_order"}]  # parsed, not JSON text
    assert "OTHERCUSTOMER" not in got.text and "token_ids" not in got.text
    assert http.get(url, headers={"Authorization": "Bearer k-bo"}).status_code == 403
    assert http.get(url).status_code == 401
    assert http.get("/console/export/customer.json?who=nobody", headers={"Authorization": "Bearer k-op"}).status_code == 404
