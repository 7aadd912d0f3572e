"""In Chromium, on the default model: a customer asks where their order is; the assistant calls
lookup_order (triggered by the order number), which tells nothing of the order until the customer
gives the e-mail address it was placed with; their next message, the address, runs it again and the
row from the orders table shows folded under the reply."""
import os

import pytest

from app import build_app, parse_args
from tests.serving import LiveServer
from tests.test_browser import SCREENSHOT_DIR
from tests.test_browser_handoff import chromium  # noqa: F401  (the shared browser fixture)

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser-tools")
    app, llm = build_app(parse_args(["--db", str(folder / "chat.db"), "--num-kv-blocks", "512",
                                     "--max-model-len", "2048"]))
    with LiveServer(llm, app) as server:
        yield server


def test_where_is_my_order_is_answered_from_the_orders_table(shop, chromium):  # noqa: F811
    from playwright.sync_api import expect

    page = chromium.new_context(viewport={"width": 390, "height": 844}).new_page()
    page.set_default_timeout(120_000)
    page.goto(f"{shop.url}/chat/support/")
    page.locator("#msg textarea").click()
    page.keyboard.type("Where is my order NW20481377?")
    page.keyboard.press("Enter")
    first = page.locator("#chatbot [data-testid='bot']").first
    expect(first.locator("details summary")).to_contain_text("lookup_order")
    expect(first.locator("details")).to_contain_text("once the customer gives the e-mail address")
    expect(first.locator("sub")).to_have_count(1)  # stored: its time shows (a reply being written has none)
    page.locator("#msg textarea").click()
    page.keyboard.type("It is dana@example.com")
    page.keyboard.press("Enter")
    expect(page.locator("#chatbot [data-testid='bot']")).to_have_count(2)
    reply = page.locator("#chatbot [data-testid='bot']").last
    expect(reply.locator("details summary")).to_contain_text("lookup_order")
    expect(reply.locator("details")).to_contain_text("→ Order NW20481377 is shipped")  # the tool has run
    reply.locator("details summary").click()
    expect(reply.locator("details")).to_contain_text("1Z999AA10123456784")  # the row, from SQLite
    expect(reply.locator("details")).to_contain_text("NW20481377")
    assert "1Z999AA10123456784" not in first.inner_text()
    assert "<tool_call>" not in reply.inner_text()
    if SCREENSHOT_DIR:
        page.screenshot(path=os.path.join(SCREENSHOT_DIR, "customer-order-lookup.png"))
