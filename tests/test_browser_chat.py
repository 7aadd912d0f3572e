"""The chat as a support agent and a customer use it, in Chromium through the keyboard and the
mouse: Enter sends, feedback, edit and resend, export/import, delete all, operator view, layout.
Runs on a tiny random-weight model (fast replies; the text is noise, the behaviour is real)."""
import json
import os
import re
import sqlite3
import threading

import pytest

from app import build_app, parse_args
from tests.serving import LiveServer, logins_file, wait_for
from tests.test_browser import CHROMIUM, FLAGS, SCREENSHOT_DIR, axe_violations

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_chat_model):
    path = tiny_chat_model
    folder = tmp_path_factory.mktemp("browser-chat")
    db = str(folder / "chat.db")
    args = parse_args(["--demo", "--db", db, "--model", path, "--dtype", "float32", "--num-kv-blocks", "512",
                       "--auth-file", logins_file(folder, alice="pw-a", bob="pw-b"), "--admin", "alice"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


@pytest.fixture(scope="module")
def browser(tmp_path_factory, app_url):  # after the server starts, so it closes before the server stops
    from playwright.sync_api import expect, sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed (make test installs Debian's chromium)")
    expect.set_options(timeout=120_000)
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM,
                                                   headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000},
                                                   timeout=180_000)
        yield ctx
        ctx.close()


@pytest.fixture(scope="module")
def page(browser, app_url):
    page = browser.new_page()
    page.set_default_timeout(120_000)
    log_in(page, app_url.url, "alice", "pw-a")
    return page


def log_in(page, url: str, name: str, password: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{url}/logout")
    page.goto(url)
    page.get_by_label("username").fill(name)
    page.get_by_label("password").fill(password)
    page.keyboard.press("Enter")
    expect(page.locator("#kv-used")).to_be_visible()


def bots(page):
    return page.locator("#chatbot [data-testid='bot']")


def new_chat(page) -> None:
    from playwright.sync_api import expect

    page.locator("#new-chat").click()
    expect(page.locator("#chatbot [data-testid='user']")).to_have_count(0)
    expect(bots(page)).to_have_count(0)


def send_by_keyboard(page, text: str) -> None:
    """Type, press Enter, and wait for this turn's own reply to finish."""
    from playwright.sync_api import expect

    turns = page.locator("#chatbot [data-testid='user']").count()
    page.locator("#msg textarea").click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")
    expect(page.locator("#chatbot [data-testid='user']")).to_have_count(turns + 1)
    expect(bots(page)).to_have_count(turns + 1)
    expect(bots(page).nth(turns)).to_contain_text("generated")


def db_rows(server, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(server.db) as conn:
        return conn.execute(sql, args).fetchall()


def test_enter_sends_shift_enter_breaks_the_line_and_the_message_shows_first(page):
    from playwright.sync_api import expect

    new_chat(page)
    page.evaluate("""() => {  // when did the user's text, and the reply's first token, first appear?
        window.__seen = {};
        new MutationObserver(() => {
            const now = performance.now(), user = document.querySelector("#chatbot [data-testid='user']");
            const bot = [...document.querySelectorAll("#chatbot [data-testid='bot']")].pop();
            if (user && user.innerText.includes('second line') && !window.__seen.user) window.__seen.user = now;
            if (bot && !bot.innerText.includes('typing') && bot.innerText.trim() && !window.__seen.bot)
                window.__seen.bot = now;
        }).observe(document.querySelector('#chatbot'), {subtree: true, childList: true, characterData: true});
    }""")
    box = page.locator("#msg textarea")
    box.click()
    page.keyboard.type("My tent arrived with a broken pole.")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("Order NW20481377, second line")
    assert box.input_value() == "My tent arrived with a broken pole.\nOrder NW20481377, second line"
    assert bots(page).count() == 0  # Shift+Enter did not send
    page.keyboard.press("Enter")
    expect(bots(page).last).to_contain_text("generated")
    seen = page.evaluate("window.__seen")
    assert seen["user"] <= seen["bot"]  # the message was on screen before the first reply token
    assert box.input_value() == ""
    assert page.evaluate("document.activeElement === document.querySelector('#msg textarea')")
    assert re.search(r"\b\d\d:\d\d\b", page.locator("#chatbot [data-testid='user']").last.inner_text())  # timestamp


def test_stop_mid_reply_aborts_the_engine_request_and_keeps_what_was_shown(page, app_url):
    """Stop, by the keyboard, on a reply allowed 1024 tokens: the engine request ends at once (its
    blocks freed, far fewer tokens than allowed), and the stored reply is the text on screen, marked."""
    from playwright.sync_api import expect

    stats = lambda: app_url.llm.run_on_engine_thread(lambda e: e.get_stats())  # noqa: E731
    new_chat(page)
    page.locator("#sampling").click()
    expect(page.locator("#sampling-note")).to_contain_text("Defaults for")  # the page's load has set the sliders
    max_tokens = page.locator("#max-tokens input[type='range']")
    for attempt in range(3):  # on a cold server the first key press can be lost (the slider stays at 256)
        max_tokens.focus()
        page.keyboard.press("End")  # the slider's maximum, by the keyboard
        try:
            expect(max_tokens).to_have_value("1024", timeout=5_000)
            break
        except AssertionError:
            if attempt == 2:
                raise
    generated_before = stats().generation_tokens_total
    page.locator("#msg textarea").fill("Tell me everything about your return policy, at length.")
    page.keyboard.press("Enter")
    # mid-reply, by the engine's count (the screen can lag seconds behind a fast model on a busy machine)
    wait_for(lambda: stats().num_running == 1 and stats().generation_tokens_total - generated_before >= 16, 120,
             "the reply to be under way")
    box, held = page.locator("#msg textarea"), threading.Event()
    hold = threading.Thread(target=app_url.llm.run_on_engine_thread, args=(lambda engine: held.wait(120), 130))
    hold.start()  # the engine waits, mid-reply, however slow the browser is
    try:  # Enter mid-reply: not sent, kept in the box, the customer told why
        box.fill("And the exchange policy?")
        box.press("Enter")
        expect(page.locator("[data-testid='toast-text']")).to_contain_text("still being written")
        assert box.input_value() == "And the exchange policy?"
        expect(page.locator("#chatbot [data-testid='user']")).to_have_count(1)
    finally:
        held.set()
        hold.join()
    page.locator("#stop").focus()
    page.keyboard.press("Enter")
    expect(bots(page).last).to_contain_text("stopped")  # the stored reply, shown with its footer
    assert box.input_value() == "And the exchange policy?"
    content, reason, generated = db_rows(app_url, "select content, finish_reason, generated_tokens from messages "
                                                  "where role = 'assistant' order by id desc limit 1")[0]
    assert reason == "abort" and 0 < generated < 1024
    after = stats()
    assert after.num_running == 0 and after.kv_blocks_used == 0  # the request left the engine, its blocks freed
    # the engine stopped before its 1024: it ran on past what the screen showed only for the stop's round trip
    assert generated <= after.generation_tokens_total - generated_before < 1024
    # the same text, compared word by word: the screen renders it as markdown (random tokens can make a
    # list, a rule or a tag of it), so line breaks and punctuation differ from the stored text
    shown_words, stored_words = (re.findall(r"[A-Za-z]{3,}", text) for text in (bots(page).last.inner_text(), content))
    assert stored_words and shown_words[:3] == stored_words[:3]
    assert " ".join(stored_words[-3:]) in " ".join(shown_words[-12:])  # what ended on screen ended in the store
    max_tokens.fill("256")
    expect(page.locator("#max-tokens input[type='number']")).to_have_value("256")
    page.locator("#sampling").click()
    box.press("Enter")  # the kept message, sent now that the chat is free
    expect(page.locator("#chatbot [data-testid='user']")).to_have_count(2)
    expect(bots(page).last).to_contain_text("generated")
    assert box.input_value() == ""


LINES_OF_TEXT = """e => {  // how many lines the element's text takes on screen
  const walk = document.createTreeWalker(e, NodeFilter.SHOW_TEXT), bottoms = [];
  while (walk.nextNode()) { const r = document.createRange(); r.selectNodeContents(walk.currentNode);
    for (const rect of r.getClientRects()) if (rect.height) bottoms.push(rect.bottom); }
  // runs on one line end within a few pixels of each other (bold and plain text differ); lines are
  // a line-height apart. (Rounding bottoms to buckets split one line in two wherever the page's
  // scroll put a bucket's edge between them.)
  bottoms.sort((a, b) => a - b);
  let lines = 0, last = -Infinity;
  for (const b of bottoms) if (b - last > 6) { lines++; last = b; }
  return lines; }"""
FOCUSED = "() => { const e = document.activeElement; return [e.id, e.getAttribute('aria-label') || '', " \
          "!!e.closest('#chatbot'), e.tagName, e.className]; }"


def test_the_keyboard_skips_to_the_box_tabs_past_the_chat_in_one_stop_and_escape_cancels_an_edit(page, app_url):
    """Tab from the top: a skip link to the message box. The conversation's per-message buttons are one
    Tab stop, walked with the arrow keys. Escape leaves an edit unchanged. axe-core finds nothing
    critical or serious, with and without an open edit box."""
    from playwright.sync_api import expect

    new_chat(page)
    for text in ("Where is my parcel?", "It was a tent."):
        send_by_keyboard(page, text)
    page.evaluate("() => { const top = document.createElement('span'); top.tabIndex = -1; "  # focus the page's top
                  "document.body.prepend(top); top.focus(); top.remove(); }")
    page.keyboard.press("Tab")
    assert page.evaluate(FOCUSED)[0] == "skip-to-message"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement === document.querySelector('#msg textarea')")

    stops = []  # Shift+Tab from the box walks back through the chat: how many stops inside it?
    for _ in range(12):
        page.keyboard.press("Shift+Tab")
        focused = page.evaluate(FOCUSED)
        if stops and stops[-1][2] and not focused[2]:
            break
        stops.append(focused)
    in_chat = [f for f in stops if f[2]]
    assert 1 <= len(in_chat) <= 2, stops  # one for the messages' buttons (plus the chat's Clear), not ten
    message_button = next(f for f in in_chat if f[1] != "Clear")
    page.keyboard.press("Tab")  # forwards again, onto the messages' one stop
    while page.evaluate(FOCUSED)[1] != message_button[1]:
        page.keyboard.press("Tab")
    seen = {page.evaluate(FOCUSED)[1]}
    for _ in range(10):  # the arrows walk the buttons of every message, up to an Edit
        page.keyboard.press("ArrowLeft")
        focused = page.evaluate(FOCUSED)
        assert focused[2], focused  # still inside the chat
        seen.add(focused[1])
        if focused[1] == "Edit":
            break
    assert {"Edit", "Like", "Copy message"} <= seen, seen
    assert axe_violations(page) == []
    page.keyboard.press("Enter")  # edit the second question, then think better of it
    editor = page.locator("#chatbot .edit-textarea")
    expect(editor).to_be_visible()
    assert editor.get_attribute("aria-label")  # the edit box is labelled
    assert axe_violations(page) == []
    editor.fill("It was a backpack.")
    page.keyboard.press("Escape")
    expect(editor).to_have_count(0)
    expect(page.locator("#chatbot [data-testid='user']").last).to_contain_text("It was a tent.")
    assert not db_rows(app_url, "select 1 from messages where content like '%backpack%'")


def test_deleting_a_chat_asks_first(page):
    from playwright.sync_api import expect

    new_chat(page)
    send_by_keyboard(page, "Please keep this chat.")
    sessions = page.locator("#sessions label").count()
    page.locator("#delete").click()
    expect(page.locator("#confirm-delete-yes")).to_be_visible()
    page.locator("#confirm-delete-no").click()  # changed my mind: nothing is deleted
    expect(page.locator("#confirm-delete")).to_be_hidden()
    assert page.locator("#sessions label").count() == sessions
    expect(page.locator("#chatbot [data-testid='user']")).to_contain_text("Please keep this chat.")
    page.locator("#delete").click()
    page.locator("#confirm-delete-yes").click()
    expect(page.locator("#sessions label")).to_have_count(sessions - 1)
    expect(page.locator("#confirm-delete")).to_be_hidden()
    assert "Please keep this chat." not in page.locator("#sessions").inner_text()


@pytest.mark.slow
def test_edit_an_earlier_message_branches_and_keeps_turn_0_cached(page, app_url):
    from playwright.sync_api import expect

    new_chat(page)
    for text in ("Where is my parcel?", "It was a tent.", "Thanks!"):
        send_by_keyboard(page, text)
    page.locator("#chatbot [data-testid='user']").nth(1).hover()
    page.locator("#chatbot button[aria-label='Edit']").nth(1).click()
    editor = page.locator("#chatbot textarea").first
    editor.fill("It was a backpack.")
    page.locator("#chatbot button[aria-label='Submit']").click()
    expect(page.locator("#chatbot [data-testid='user']")).to_have_count(2)
    expect(bots(page)).to_have_count(2)
    expect(bots(page).last).to_contain_text("generated")
    assert "backpack" in page.locator("#chatbot [data-testid='user']").last.inner_text()
    turn0 = db_rows(app_url, "select token_ids from messages where content = 'Where is my parcel?'")[0][0]
    reply0 = db_rows(app_url, "select token_ids from messages where id = (select min(id) from messages where "
                              "role = 'assistant' and id > (select id from messages where content = 'Where is my parcel?'))")
    context = len(json.loads(turn0)) + len(json.loads(reply0[0][0]))
    cached = int(re.search(r"cached (\d+)", bots(page).last.inner_text()).group(1))
    assert cached >= context - 16  # the untouched history came from the prefix cache
    kept = {r[0] for r in db_rows(app_url, "select content from messages where replaced is not null")}
    assert {"It was a tent.", "Thanks!"} <= kept  # the old branch is kept in the database


def test_feedback_survives_a_reload_and_reaches_the_operator_view(page, app_url):
    from playwright.sync_api import expect

    new_chat(page)
    send_by_keyboard(page, "Can I get a refund?")
    page.locator("#chatbot button[aria-label='Dislike']").last.click()
    page.locator("#comment textarea").fill("It never answered the refund question.")
    page.keyboard.press("Enter")
    expect(page.locator("#comment-row")).to_be_hidden()
    page.reload()
    expect(bots(page).last).to_contain_text("generated")
    expect(page.locator("#chatbot button[aria-label='Disliked']")).to_have_count(1)
    page.locator("#review").click()
    page.locator("#review-refresh").click()
    expect(page.locator("#review-table")).to_contain_text("It never answered the refund question.")
    with page.expect_download() as download:
        page.locator("#review-downloads a", has_text="CSV").focus()
        page.keyboard.press("Enter")
    text = open(download.value.path(), encoding="utf-8").read()
    assert "It never answered the refund question." in text and "Can I get a refund?" in text
    os.makedirs(SCREENSHOT_DIR, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOT_DIR, "operator-review.png"), full_page=True)


def test_an_exported_chat_imports_back_identical_and_delete_all_asks_first(page, app_url, tmp_path):
    from playwright.sync_api import expect

    new_chat(page)
    send_by_keyboard(page, "Export me, please.")
    page.locator("#transfer").click()
    page.locator("#export-json").click()
    with page.expect_download() as download:
        page.locator("#export-file a").first.click()
    exported = tmp_path / "chat.json"
    download.value.save_as(exported)
    original = json.loads(exported.read_text())
    sessions_before = page.locator("#sessions label").count()
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(exported))
    expect(page.locator("#sessions label")).to_have_count(sessions_before + 1)
    expect(page.locator("#chatbot [data-testid='user']").last).to_contain_text("Export me, please.")
    imported = db_rows(app_url, "select role, content, token_ids from messages where session_id = "
                                "(select id from sessions order by created desc limit 1) order by id")
    assert [(r, c, json.loads(t)) for r, c, t in imported] == \
        [(m["role"], m["content"], m["token_ids"]) for m in original["messages"]]

    page.locator("#delete-all").click()
    expect(page.locator("#confirm-yes")).to_be_visible()
    page.locator("#confirm-no").click()  # changed my mind: nothing is deleted
    expect(page.locator("#confirm-yes")).to_be_hidden()
    assert page.locator("#sessions label").count() == sessions_before + 1
    page.locator("#delete-all").click()
    page.locator("#confirm-yes").click()
    expect(page.locator("#sessions label")).to_have_count(1)
    expect(bots(page)).to_have_count(0)


def test_panel_model_line_narrow_layout_and_dark_mode(page):
    from playwright.sync_api import expect

    new_chat(page)
    send_by_keyboard(page, "A first question long enough to fill the whole width of a phone's chat bubble")

    expect(page.locator("#model-line")).to_contain_text("quantization")
    expect(page.locator("#tokens-per-char")).to_be_visible()
    assert page.get_by_text("Memory (MiB)").count() >= 1
    page.locator("#theme-toggle").click()
    assert page.evaluate("document.body.classList.contains('dark')")
    page.reload()
    expect(page.locator("#kv-used")).to_be_visible()
    assert page.evaluate("document.body.classList.contains('dark')")  # remembered
    page.screenshot(path=os.path.join(SCREENSHOT_DIR, "dark.png"))
    page.locator("#theme-toggle").click()
    try:
        page.set_viewport_size({"width": 390, "height": 844})
        page.reload()  # a phone opens the page at this size
        expect(page.locator("#kv-used")).to_be_visible()
        expect(page.locator(".sidebar.open")).to_have_count(0)  # the chats list waits behind its toggle
        chat_box, panel_box = page.locator("#chatbot").bounding_box(), page.locator("#panel").bounding_box()
        assert panel_box["y"] >= chat_box["y"] + chat_box["height"]  # the panel folds under the chat
        assert page.evaluate("document.documentElement.scrollWidth") <= 390 + 1  # no sideways scrolling
        page.screenshot(path=os.path.join(SCREENSHOT_DIR, "narrow.png"), full_page=True)
        toggle = page.locator("button[aria-label='Toggle Sidebar']").bounding_box()
        assert toggle["x"] >= 2 and toggle["x"] + toggle["width"] <= 390  # wholly on screen, clear of the edge
        lines = page.locator("#model-line").evaluate(LINES_OF_TEXT)
        assert lines <= 3.5  # the model line: three lines at most on a phone (it took five)
        expect(page.locator("#tokens-per-char")).to_be_hidden()  # a wide screen's detail
        clear = page.locator("#chatbot button[aria-label='Clear']")
        page.locator("#chatbot .bubble-wrap").evaluate("e => { e.scrollTop = 0; }")  # the chat scrolled to its start
        user_first = page.locator("#chatbot [data-testid='user']").first.bounding_box()
        assert user_first["y"] >= clear.bounding_box()["y"] + clear.bounding_box()["height"]  # no bubble over the trash
        assert axe_violations(page) == []
        page.screenshot(path=os.path.join(SCREENSHOT_DIR, "narrow.png"), full_page=True)
    finally:  # the next tests use this page at its wide size
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.reload()
    expect(page.locator(".sidebar.open")).to_have_count(1)


def test_the_operator_resets_the_prefix_cache_from_the_page(page, app_url):
    from playwright.sync_api import expect

    new_chat(page)
    send_by_keyboard(page, "What are your opening hours?")
    expect(bots(page).last).to_contain_text("generated")
    cached = lambda: app_url.llm.run_on_engine_thread(lambda e: set(e.kv.pool.cached))  # noqa: E731  (hashes)
    before = cached()
    assert before
    page.locator("#cache-controls").click()
    page.locator("#reset-cache").click()
    expect(page.locator("#reset-status")).to_contain_text("Prefix cache reset")
    assert not before & cached()  # every prefix cached before is forgotten (a reply ending since may cache its own)


def test_a_visitor_sees_the_panel_but_not_the_operator_controls(page, app_url):
    from playwright.sync_api import expect

    log_in(page, app_url.url, "bob", "pw-b")
    expect(page.locator("#panel")).to_be_visible()
    assert page.locator("#operator").count() == 0 or not page.locator("#operator").is_visible()
    assert page.locator("#switch").count() == 0 or not page.locator("#switch").is_visible()
    log_in(page, app_url.url, "alice", "pw-a")
    expect(page.locator("#operator")).to_be_visible()
