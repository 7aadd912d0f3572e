"""In Chromium: an operator uploads a policy document to the default assistant in the console; a
customer asks about it and sees its source under the reply (the link opens the excerpt); a second
chat citing the same article reuses its KV blocks (the stored cached_tokens cover them)."""
import os

import pytest

from app import build_app, parse_args
from bench.knowledge import FOLDER
from storage import Store
from tests.serving import LiveServer, logins_file
from tests.test_browser import SCREENSHOT_DIR
from tests.test_browser_handoff import chromium, logged_in  # noqa: F401  (the shared browser fixture)

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture(scope="module")
def shop(tmp_path_factory, tiny_chat_model):
    folder = tmp_path_factory.mktemp("browser-knowledge")
    db = str(folder / "chat.db")
    args = parse_args(["--db", db, "--model", tiny_chat_model, "--dtype", "float32", "--num-kv-blocks", "512",
                       "--auth-file", logins_file(folder, cara="pw-c", dana="pw-d", olga="pw-o"), "--admin", "olga"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


def ask(page, text):
    from playwright.sync_api import expect

    before = page.locator("#chatbot [data-testid='bot']").count()
    page.locator("#msg textarea").click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")
    expect(page.locator("#chatbot [data-testid='bot']")).to_have_count(before + 1)
    return page.locator("#chatbot [data-testid='bot']").last


def test_an_uploaded_policy_answers_with_its_source_and_its_blocks_are_reused(shop, chromium):  # noqa: F811
    from playwright.sync_api import expect

    operator = logged_in(chromium, f"{shop.url}/console/", "olga", "pw-o")
    expect(operator.locator("#assistant-slug textarea, #assistant-slug input").first).to_have_value("support")
    operator.locator("#knowledge-upload input[type=file]").set_input_files(os.path.join(FOLDER, "returns.md"))
    expect(operator.locator("#knowledge-status")).to_contain_text("returns.md: indexed, 3 chunks")
    expect(operator.locator("#knowledge-documents")).to_contain_text("returns.md")

    customer = logged_in(chromium, f"{shop.url}/chat/support/", "cara", "pw-c", width=390, height=844)
    reply = ask(customer, "How long do refunds take?")
    source = reply.locator("a", has_text="returns.md › Refunds")
    expect(source).to_be_visible()
    href = source.get_attribute("href")
    excerpt = chromium.new_page()
    excerpt.goto(shop.url + href if href.startswith("/") else href)
    expect(excerpt.locator("body")).to_contain_text("original payment method")
    if SCREENSHOT_DIR:
        customer.screenshot(path=os.path.join(SCREENSHOT_DIR, "customer-knowledge-source.png"))

    other = logged_in(chromium, f"{shop.url}/chat/support/", "dana", "pw-d")
    expect(ask(other, "Hi! How long do refunds take, please?").locator("a", has_text="returns.md › Refunds")).to_be_visible()
    store = Store(shop.db)
    turns = []  # (the turn's prompt ids, its reply) of each customer's chat
    for user in ("login:cara", "login:dana"):
        for session in store.sessions(user):
            messages = store.messages(user, session["id"])
            turns += [(messages[i - 1]["token_ids"], m) for i, m in enumerate(messages)
                      if m["role"] == "assistant" and m["sources"]]
    (first_prompt, first), (second_prompt, second) = sorted(turns, key=lambda t: t[1]["created"])[:2]
    assert [s["id"] for s in first["sources"]] == [s["id"] for s in second["sources"]]
    common = next((i for i, (a, b) in enumerate(zip(first_prompt, second_prompt)) if a != b), len(first_prompt))
    assert common >= 0.8 * len(first_prompt)  # system prompt and knowledge: all but the question
    assert second["cached_tokens"] >= common // 16 * 16  # ... and the second chat computed none of its blocks
