"""Fast tier: payment card numbers are masked before they are stored or reach the model: typed by a
customer (the model path and the person path), replied by an agent, or in an imported chat. Other
numbers (order numbers, phone numbers, a Luhn-invalid run) are left as typed."""
import asyncio
import json
from types import SimpleNamespace

import gradio as gr
import pytest

from storage import Store
from tests.fakes import FakeEngineClient
from ui.cards import hide_cards, looks_like_card
from ui.handlers import ChatHandlers
from ui.inbox import InboxHandlers

VISA, MASTERCARD, AMEX = "4111111111111111", "5555555555554444", "378282246310005"


@pytest.mark.parametrize("text, shown, n", [
    ("my card is 4111 1111 1111 1111 exp 12/27", "my card is •••• •••• •••• 1111 exp 12/27", 1),
    ("4111-1111-1111-1111", "••••-••••-••••-1111", 1),
    (f"{VISA}.", "••••••••••••1111.", 1),
    (f"amex {AMEX}", "amex •••••••••••0005", 1),
    ("5555 5555 5555 4444 12 27 cvc 123", "•••• •••• •••• 4444 12 27 cvc 123", 1),  # the expiry is not part of it
    (f"two: {VISA} and 5500-0000-0000-0004", "two: ••••••••••••1111 and ••••-••••-••••-0004", 2),
    (f"카드번호 {VISA}입니다", "카드번호 ••••••••••••1111입니다", 1),  # a Korean particle right after it
    (f"번호{MASTERCARD}", "번호••••••••••••4444", 1),
    ("2223 0031 2200 3222", "•••• •••• •••• 3222", 1),  # Mastercard's 2-series
])
def test_a_card_number_keeps_its_last_four_digits_and_its_separators(text, shown, n):
    assert hide_cards(text) == (shown, n)


@pytest.mark.parametrize("text", [
    "Where is my order NW20481377?",
    "4111 1111 1111 1112",  # fails the check digit
    "call +1 415 555 0134 or +44 20 7946 0958",
    "+4111111111111111",  # a phone number's "+", not a card
    "tracking 1234567890123",  # no card network starts with 1
    "v1.4111111111111111", "x4111111111111111", "99999999999999999999999",
])
def test_other_numbers_are_left_as_typed(text):
    assert hide_cards(text) == (text, 0)


def test_the_check_is_luhn_over_a_network_range():
    assert looks_like_card(VISA) and looks_like_card(AMEX) and looks_like_card(MASTERCARD)
    assert not looks_like_card(VISA[:-1] + "2") and not looks_like_card("1" + VISA[1:])
    assert not looks_like_card(VISA[:12]) and not looks_like_card(VISA + "0000")  # 12 and 20 digits


def test_a_long_run_of_digits_is_scanned_in_linear_time():
    many = " ".join(["4111 1111 1111 1111"] * 500)
    assert hide_cards(many)[1] == 500
    assert hide_cards(" ".join(["1"] * 20000))[1] == 0


def customer(name: str):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}", headers={},
                           request=SimpleNamespace(path_params={"assistant": "support"}))


@pytest.fixture
def shop(smol_tokenizer, tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(gr, "Info", said.append)
    fake = FakeEngineClient(smol_tokenizer, max_model_len=1024)
    store = Store(str(tmp_path / "chat.db"))
    return SimpleNamespace(fake=fake, store=store, said=said, tokenizer=smol_tokenizer,
                           chat=ChatHandlers(fake, store, demo=False, staffed=True),
                           inbox=InboxHandlers(store, {"alex"}))


def send(shop, who: str, text: str):
    uid, sid = shop.chat.current(None, None, customer(who))
    asyncio.run(_drain(shop.chat.send(uid, sid, text, request=customer(who))))
    return uid, sid


async def _drain(gen):
    return [update async for update in gen]


def everything_stored(store: Store) -> str:
    with store._db() as db:
        return json.dumps([list(row) for row in db.conn.execute("select * from messages")]) + \
            json.dumps([list(row) for row in db.conn.execute("select * from sessions")])


def test_a_customers_card_number_never_reaches_the_model_or_the_database(shop):
    uid, sid = send(shop, "cara", f"Please charge my card {VISA} for the tent")
    prompt = shop.tokenizer.decode(shop.fake.requests[-1]["prompt"])
    assert "••••••••••••1111" in prompt and VISA not in prompt and "411111" not in prompt
    stored = shop.store.messages(uid, sid)[0]
    assert stored["content"] == "Please charge my card ••••••••••••1111 for the tent"
    assert shop.store.session(uid, sid)["title"].startswith("Please charge my card ••••")
    assert VISA not in everything_stored(shop.store) and "411111111111" not in everything_stored(shop.store)
    assert any("card numbers" in str(s) for s in shop.said)  # the customer is told why it shows masked


def test_the_message_shows_masked_as_soon_as_it_is_sent(shop):
    box, history, pending = shop.chat.stage(f"card {VISA}", [])
    assert history[0]["content"].endswith("••••••••••••1111") and box == ""


def test_a_card_number_for_a_person_and_from_one_is_masked(shop, monkeypatch):
    monkeypatch.setattr(gr, "Warning", lambda *a: None)
    uid, sid = send(shop, "dan", "talk to a person")
    send(shop, "dan", f"my card {MASTERCARD} was charged twice")
    agent = SimpleNamespace(username="alex", session_hash="console-alex")
    shop.inbox.take(sid, agent)
    shop.inbox.reply(sid, f"I see the charge on {AMEX}, refunding it", agent)
    contents = [m["content"] for m in shop.store.messages(uid, sid)]
    assert "my card ••••••••••••4444 was charged twice" in contents
    assert "I see the charge on •••••••••••0005, refunding it" in contents
    stored = everything_stored(shop.store)
    assert MASTERCARD not in stored and AMEX not in stored


def test_an_imported_chat_is_masked_and_rendered_again_from_its_text(shop, tmp_path):
    uid, _ = shop.chat.current(None, None, customer("eve"))
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"format": "pagedchat.chat/1", "title": "old", "messages": [
        {"role": "user", "content": f"card {VISA}", "token_ids": [1, 2, 3]},
        {"role": "assistant", "content": "Thanks", "token_ids": [4]}]}))
    _, sid, *_ = shop.chat.import_chat(uid, str(path), customer("eve"))
    messages = shop.store.messages(uid, sid)
    assert messages[0]["content"] == "card ••••••••••••1111" and all(m["token_ids"] == [] for m in messages)
    assert VISA not in everything_stored(shop.store)
