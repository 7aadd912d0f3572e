"""Fast tier: links the shop vouches for. In the customer chat a reply's address is a link only where
its site is in what the shop wrote for the assistant (prompt, greeting, quick and canned replies,
tool endpoints, documents) or in the chat (the customer's words, a person's, a tool's result); any
other shows as unclickable text. The stored reply, the API and the demo page keep what the model wrote."""
import asyncio
from types import SimpleNamespace

import pytest

from storage import Store
from tests.fakes import FakeEngineClient
from ui import assistants
from ui.handlers import ChatHandlers
from ui.links import assistant_hosts, guard, hosts_in

SHOP = frozenset({"northwind.example"})


@pytest.mark.parametrize("written, shown", [
    ("Visit https://www.north-west.com/returns now.", "Visit `https://www.north-west.com/returns` now."),
    ("See https://northwind.example/returns.", "See https://northwind.example/returns."),
    ("Help at https://help.northwind.example/x", "Help at https://help.northwind.example/x"),
    ("Try https://northwind.example.evil.com/", "Try `https://northwind.example.evil.com/`"),
    ("Go to www.evil.com or www.northwind.example", "Go to `www.evil.com` or www.northwind.example"),
    ("Mail support@north-west.com, or help@northwind.example.",
     "Mail `support@north-west.com`, or help@northwind.example."),
    ("[our returns page](https://evil.com/r) and [ours](https://northwind.example/r)",
     "our returns page and [ours](https://northwind.example/r)"),
    ("[https://evil.com](https://evil.com)", "`https://evil.com`"),
    ("![logo](http://evil.com/p.png) ![ours](https://northwind.example/l.png)",
     " ![ours](https://northwind.example/l.png)"),
    ("[click](javascript:alert(1)) [wiki](https://en.wikipedia.org/wiki/Tent_(camping))", "click wiki"),
    ('<a href="https://evil.com/x">click here</a> <img src="https://evil.com/t.gif">', "click here "),
    ('<a href="https://northwind.example/x">ours</a>', '<a href="https://northwind.example/x">ours</a>'),
    ("<https://evil.com/x>", "`https://evil.com/x`"),
    ("`https://evil.com` and\n```\ncurl https://evil.com\n```", "`https://evil.com` and\n```\ncurl https://evil.com\n```"),
    ("Version 1.2@3.4, no address here.", "Version 1.2@3.4, no address here."),
])
def test_an_address_is_a_link_only_where_the_shop_vouches_for_its_site(written, shown):
    assert guard(written, SHOP) == shown


def test_the_sites_an_assistant_vouches_for_come_from_what_the_shop_wrote():
    version = {"system_prompt": "Our site is https://Northwind.example/help.", "greeting": "Mail care@northwind.help",
               "quick_replies": ["Track at www.track.example"], "canned": {"/kb": "See https://kb.example/a"},
               "tools": ["lookup_order", {"name": "stock", "url": "https://api.shop.example/stock"}]}
    assert assistant_hosts(version, ["Call us or see http://docs.example/faq."]) == {
        "northwind.example", "northwind.help", "track.example", "kb.example", "api.shop.example",
        "docs.example"}
    assert hosts_in("no address, 3.5 stars, a@b") == set()


def tab(name="cara"):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}")


def turn(chat, text, who="cara"):
    async def run():
        uid, sid = chat.current(None, None, tab(who))
        sliders = (0.0, 1.0, 64, 1.0) if chat.demo else ()
        updates = [u async for u in chat.send(uid, sid, text, *sliders, request=tab(who))]
        return uid, sid, updates[-1][0]
    return asyncio.run(run())


REPLY = (" Start at https://northwind.example/returns or https://fake-returns.com/start; mail help@northwind.example,"
         " refunds@fake-returns.com or [the form](https://fake-returns.com/form).")


def test_the_customer_chat_shows_only_vouched_addresses_as_links_and_stores_the_reply_as_written(tmp_path, smol_tokenizer):
    store = Store(str(tmp_path / "c.db"))
    chat = ChatHandlers(FakeEngineClient(smol_tokenizer, max_model_len=4096, reply=REPLY), store, demo=False)
    base = store.assistant(assistants.DEFAULT_SLUG)
    assistants.save(store, assistants.DEFAULT_SLUG, {**base, "system_prompt": base["system_prompt"]
                                                     + " Our website is https://northwind.example."}, "test")
    uid, sid, shown = turn(chat, "How do I return my tent?")
    reply = shown[-1]["content"]
    assert "https://northwind.example/returns " in reply and "help@northwind.example," in reply
    assert "`https://fake-returns.com/start`" in reply and "`refunds@fake-returns.com`" in reply
    assert "fake-returns.com/form" not in reply and "the form" in reply
    assert store.messages(uid, sid)[-1]["content"].strip() == REPLY.strip()
    # opening the chat again (a reload, another tab) shows the same
    assert chat.show_session(uid, sid)[2][-1]["content"] == reply
    # the customer names the site themselves: in their own chat it is theirs to follow
    _, _, shown = turn(chat, "I found fake-returns.com, is https://fake-returns.com/start yours?")
    assert "https://fake-returns.com/start;" in shown[-1]["content"]
    _, _, other = turn(chat, "How do I return my tent?", who="dana")
    assert "`https://fake-returns.com/start`" in other[-1]["content"]


def test_knowledge_and_tool_results_vouch_and_the_demo_page_shows_replies_as_written(tmp_path, smol_tokenizer):
    store = Store(str(tmp_path / "c.db"))
    chat = ChatHandlers(FakeEngineClient(smol_tokenizer, max_model_len=4096, reply=REPLY), store, demo=False)
    chat.knowledge.add(assistants.DEFAULT_SLUG, "returns.html",
                       b'<h1>Returns</h1><p>Returns start on <a href="https://fake-returns.com/start">the form</a>.</p>')
    uid, sid, shown = turn(chat, "How do I return my tent?")
    assert "https://fake-returns.com/start;" in shown[-1]["content"]  # the document's link came through the HTML
    assert "`https://northwind.example/returns`" in shown[-1]["content"]
    chat.knowledge.remove(assistants.DEFAULT_SLUG, "returns.html")  # the document goes: so does its site
    assert "`https://fake-returns.com/start`" in chat.show_session(uid, sid)[2][-1]["content"]
    demo = ChatHandlers(FakeEngineClient(smol_tokenizer, max_model_len=4096, reply=REPLY),
                        Store(str(tmp_path / "d.db")), demo=True)
    _, _, shown = turn(demo, "How do I return my tent?")
    assert REPLY.strip() in shown[-1]["content"]
    messages = [{"role": "assistant", "content": "Track it on https://ups.example/1Z99.", "created": 0,
                 "tool_calls": [{"name": "lookup_order", "arguments": "{}", "result": '{"url": "https://ups.example/1Z99"}'}]}]
    from ui.display import customer_display
    assert customer_display(messages)[0]["content"].startswith("Track it on https://ups.example/1Z99.")
    assert customer_display([{**messages[0], "tool_calls": []}])[0]["content"].startswith("Track it on `https://ups")
