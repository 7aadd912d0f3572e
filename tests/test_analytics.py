"""Fast tier: the operators' analytics from SQLite, per day and per assistant, and the CSV that a
spreadsheet opens with Hangul intact."""
import time
from types import SimpleNamespace

import pytest

from storage import Store, analytics
from storage.handoff import Handoff
from tests.fakes import FakeEngineClient
from ui import downloads
from ui.console import AnalyticsHandlers
from ui.operator import OperatorHandlers


def chat(store, user, assistant, turns, *, ttfts, feedback=(), handoff=False, cached=0):
    sid = store.create_session(user, assistant=assistant, assistant_version=1)
    for i in range(turns):
        store.add_message(user, sid, "user", f"질문 {i}", [])
        mid = store.add_message(user, sid, "assistant", "답변", [1, 2], prompt_tokens=100, cached_tokens=cached,
                                generated_tokens=10, ttft=ttfts[i])
        if i < len(feedback):
            store.set_feedback(user, sid, mid, feedback[i])
    if handoff:
        Handoff(store).ask(sid)
    return sid


def test_a_day_per_assistant_counts_what_happened(tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    chat(store, "u1", "support", 2, ttfts=[0.1, 0.3], feedback=[1, -1], cached=80)
    chat(store, "u2", "support", 1, ttfts=[0.2], feedback=[1], handoff=True, cached=80)
    chat(store, "u3", "sales", 1, ttfts=[2.0])
    rows = {r["assistant"]: r for r in analytics.daily(store, 7)}
    support = rows["support"]
    assert (support["chats"], support["turns"], support["tokens generated"]) == (2, 3, 30)
    assert support["handoff rate"] == 0.5 and support["thumbs-up rate"] == round(2 / 3, 3)
    assert support["TTFT p50 (ms)"] == 200 and support["TTFT p95 (ms)"] == 300
    assert support["cached share of prompt tokens"] == 0.8
    assert rows["sales"]["chats"] == 1 and rows["sales"]["thumbs-up rate"] is None
    assert analytics.daily(store, 7, now=time.time() + 30 * 86400) == []  # outside the range


def test_the_csv_opens_in_a_spreadsheet_and_only_operators_get_it(tmp_path, smol_tokenizer):
    store = Store(str(tmp_path / "chat.db"))
    chat(store, "u1", "고객센터", 1, ttfts=[0.1])
    operator = OperatorHandlers(FakeEngineClient(smol_tokenizer), store, {"m": None}, None, {"olga"})
    numbers = AnalyticsHandlers(store, operator)
    raw = downloads.body(store, "analytics.csv", 30).encode()  # the route sends it as UTF-8
    assert raw.startswith(b"\xef\xbb\xbf") and "고객센터".encode() in raw
    table, plot, _ = numbers.table(30, SimpleNamespace(username="olga"))
    assert table[0][1] == "고객센터" and set(plot["series"]) == {"고객센터 chats", "고객센터 turns"}
    import gradio as gr
    with pytest.raises(gr.Error):
        numbers.table(30, SimpleNamespace(username="cara"))


def test_what_customers_ask_about_that_no_document_mentions_are_the_knowledge_bases_gaps(tmp_path):
    from storage.knowledge import Knowledge

    store = Store(str(tmp_path / "chat.db"))
    kb = Knowledge(store)
    kb.add("support", "returns.md", b"# Returns\n\nUnused items can be returned within thirty days. We ship fast.")

    def turn(user, assistant, question, **reply):
        sid = store.create_session(user, assistant=assistant, assistant_version=1)
        store.add_message(user, sid, "user", question, [])
        store.add_message(user, sid, "assistant", "An answer.", [1], **reply)
    turn("u1", "support", "Do you ship to Canada?")
    turn("u2", "support", "do you ship to  canada")  # the same question, asked otherwise
    turn("u3", "support", "캐나다로 배송되나요?")
    turn("u4", "support", "Can I return unused items?")  # the documents have every word of it
    turn("u5", "support", "Thanks a lot!")  # small talk
    turn("u6", "support", "Where is my order NW20481377?", tool_calls=[{"name": "lookup_order", "arguments": "{}"}])
    turn("u7", "support", "Is the warranty transferable?", author="agent:alex")  # a person answered it
    turn("u8", "sales", "Do you ship to Canada?")  # sales has no documents: nothing to fill
    gaps = analytics.unanswered(store, 7)
    assert [(g["question"], g["words no document has"], g["times asked"], g["assistant"]) for g in gaps] == [
        ("do you ship to  canada", "canada", 2, "support"), ("캐나다로 배송되나요?", "캐나다로, 배송되나요", 1, "support")]
    assert analytics.unanswered(store, 7, now=time.time() + 30 * 86400) == []
    operator = OperatorHandlers(None, store, {"m": None}, None, {"olga"})
    assert AnalyticsHandlers(store, operator).table(7, SimpleNamespace(username="olga"))[2][0][:3] == [
        "do you ship to  canada", "canada", 2]
    kb.add("support", "shipping.md", "# Shipping\n\nWe ship to Canada in five days.\n\n캐나다 배송: 5일.".encode())
    assert analytics.unanswered(store, 7) == []  # the new document closes both gaps at once (Korean by its stems)
