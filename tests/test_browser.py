"""One real browser (Debian's Chromium driven by Playwright) against the real app."""
import os
import shutil

import pytest

from app import build_app, parse_args
from tests.serving import LiveServer

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SCREENSHOT_DIR = os.environ.get("PAGEDCHAT_SCREENSHOTS", "test-artifacts")
AXE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".tools", "axe", "node_modules",
                   "axe-core", "axe.min.js")  # `make browser` installs axe-core 4.14.1 from the npm registry


def axe_violations(page, impacts=("critical", "serious")) -> list[str]:
    """axe-core's accessibility check of the page as it is now: the violations of these impacts,
    one line each (rule, and the elements it found)."""
    if not os.path.exists(AXE):
        pytest.fail("axe-core is not installed (make browser installs it under .tools/axe)")
    if not page.evaluate("typeof axe !== 'undefined'"):
        page.add_script_tag(path=AXE)
    found = page.evaluate("async () => (await axe.run()).violations.map(v => ({id: v.id, impact: v.impact, "
                          "nodes: v.nodes.map(n => n.target.join(' '))}))")
    toasts = page.locator("[data-testid='toast-text']").all_text_contents()  # what a toast said, if one shows
    return [f"{v['impact']} {v['id']}: {', '.join(v['nodes'][:6])}" + (f" (toasts: {toasts})" if toasts else "")
            for v in found if v["impact"] in impacts]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser")
    db = str(folder / "chat.db")
    app, llm = build_app(parse_args(["--demo", "--db", db, "--num-kv-blocks", "512", "--max-model-len", "2048",
                                     "--kv-disk", str(folder / "kv")]))
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


@pytest.fixture(scope="module")
def app_url(served):
    return served.url


def test_the_page_publishes_no_signing_secret(served):
    import httpx

    from storage import Store

    page = httpx.get(served.url)
    config = httpx.get(f"{served.url}/config", cookies=page.cookies)
    assert "pagedchat_visitor" in page.headers["set-cookie"] and "HttpOnly" in page.headers["set-cookie"]
    assert config.status_code == 200 and Store(served.db).secret() not in page.text + config.text
    assert '"secret"' not in config.text


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed (.ci/run installs Debian's chromium)")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM,
                                                   headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000},
                                                   timeout=180_000)
        page = ctx.new_page()
        page.set_default_timeout(120_000)
        yield page
        ctx.close()


@pytest.mark.slow
def test_chat_in_a_real_browser(app_url, page):
    from playwright.sync_api import expect

    expect.set_options(timeout=120_000)
    page.goto(app_url)
    expect(page.locator("#kv-used")).to_be_visible()
    generated_before = int(page.locator("#gen-total").inner_text())
    # count text changes of the reply as it streams, inside the page
    page.evaluate("""() => {
        window.__changes = 0;
        new MutationObserver(() => window.__changes++).observe(
            document.querySelector('#chatbot'), {subtree: true, childList: true, characterData: true});
    }""")
    page.locator("#msg textarea").fill("Hi! <b>bold?</b> <img src=x onerror='window.__pwned=1'> Where is my parcel?")
    page.locator("#send").click()
    bot = page.locator("#chatbot [data-testid='bot']").last
    expect(bot).to_contain_text("generated")  # the footer appears when the reply is finished
    assert page.evaluate("window.__changes") > 5  # it streamed
    assert page.evaluate("window.__pwned") is None  # HTML in a message is inert
    expect(page.locator("#gen-total")).not_to_have_text(str(generated_before))  # the panel moved
    expect(page.locator("#kv-disk-blocks")).not_to_have_text("0")  # and the disk tier took the chat's blocks
    expect(page.locator("#spec")).to_contain_text("speculation: kept")  # on by default, its share shown
    first_reply = bot.inner_text()

    page.locator("#new-chat").click()
    expect(page.locator("#chatbot [data-testid='bot']")).to_have_count(0)
    page.locator("#msg textarea").fill("Second chat: how do I return a tent?")
    page.locator("#send").click()
    expect(page.locator("#chatbot [data-testid='bot']").last).to_contain_text("generated")
    expect(page.locator("#sessions label")).to_have_count(2)

    page.reload()  # history comes back from SQLite, for the same browser
    expect(page.locator("#sessions label")).to_have_count(2)
    visitor = [c for c in page.context.cookies() if c["name"] == "pagedchat_visitor"]
    assert visitor and visitor[0]["httpOnly"] and "pagedchat_visitor" not in page.evaluate("document.cookie")
    page.context.clear_cookies()  # another browser (or a forged id) is another visitor: none of these chats
    page.reload()
    expect(page.locator("#sessions label")).to_have_count(1)
    page.context.add_cookies(visitor)
    page.reload()
    expect(page.locator("#sessions label")).to_have_count(2)
    page.locator("#sessions label").filter(has_text="Hi!").click()
    expect(page.locator("#chatbot [data-testid='bot']").last).to_contain_text(first_reply.split("\n")[0][:40])
    os.makedirs(SCREENSHOT_DIR, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOT_DIR, "chat.png"), full_page=True)
