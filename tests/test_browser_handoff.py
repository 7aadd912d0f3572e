"""The customer deployment in Chromium: a customer on a phone-sized screen sees only the chat (no
prompt, sampling or engine panel), asks for a person with the keyboard, and an agent in the
console takes the chat and replies; the reply shows in the customer's open tab without a reload,
and the chat goes back to the assistant."""
import os
import re

import pytest

from app import build_app, parse_args
from tests.serving import LiveServer, logins_file
from tests.test_browser import CHROMIUM, FLAGS, SCREENSHOT_DIR, axe_violations

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


@pytest.fixture(scope="module")
def shop(tmp_path_factory, tiny_chat_model):
    folder = tmp_path_factory.mktemp("browser-handoff")
    args = parse_args(["--db", str(folder / "chat.db"), "--model", tiny_chat_model, "--dtype", "float32",
                       "--num-kv-blocks", "512", "--auth-file", logins_file(folder, cara="pw-c", min="pw-m", alex="pw-x"),
                       "--agent", "alex"])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        yield server


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import expect, sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed (make test installs Debian's chromium)")
    expect.set_options(timeout=120_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS, timeout=180_000)
        yield browser
        browser.close()


def logged_in(chromium, url: str, name: str, password: str, locale: str = "en-US", **viewport):
    page = chromium.new_context(viewport=viewport or {"width": 1400, "height": 1000}, locale=locale).new_page()
    page.set_default_timeout(120_000)
    page.goto(url)
    page.locator("input[type=password]").wait_for()  # the login form (its labels are in the page's language)
    page.locator("input:not([type=password])").first.fill(name)
    page.locator("input[type=password]").fill(password)
    page.keyboard.press("Enter")
    return page


def take_and_reply(agent, shows: str, reply: str) -> None:
    """The agent (alex) picks the first chat in the inbox with the keyboard, sees `shows` in it,
    takes it and sends `reply`."""
    from playwright.sync_api import expect

    agent.locator("#inbox-pick input").click()
    agent.keyboard.press("ArrowDown")
    agent.keyboard.press("Enter")
    expect(agent.locator("#inbox-chat")).to_contain_text(shows)
    agent.locator("#inbox-take").click()
    expect(agent.locator("#inbox-state")).to_contain_text("with a person (alex)")
    agent.locator("#inbox-reply textarea").click()
    agent.keyboard.type(reply)
    agent.keyboard.press("Enter")


def test_a_customer_hands_over_to_an_agent_and_back(shop, chromium):
    from playwright.sync_api import expect

    customer = logged_in(chromium, f"{shop.url}/", "cara", "pw-c", width=390, height=844)  # / leads to the chat
    expect(customer.locator("#msg textarea")).to_be_visible()
    assert "/chat/support" in customer.url
    for absent in ("#system", "#temperature", "#panel", "#model-line", "#operator"):
        assert customer.locator(absent).count() == 0, absent
    expect(customer.locator("#assistant-name")).to_contain_text("Northwind")
    assert axe_violations(customer) == []  # axe-core: nothing critical or serious on the phone-sized chat
    customer.locator("#msg textarea").click()
    customer.keyboard.type("My tent arrived torn, I want to talk to a person")
    customer.keyboard.press("Enter")
    expect(customer.locator("#person-status")).to_contain_text("No one from our team is online")  # no console open
    expect(customer.locator("#person-status")).to_contain_text("(number 1)")
    expect(customer.locator("#back-to-assistant")).to_be_visible()
    expect(customer.locator("#talk-to-person")).to_be_hidden()  # the two buttons swap while the chat waits
    expect(customer.locator("#chatbot [data-testid='bot']")).to_have_count(0)  # the model stayed quiet
    if SCREENSHOT_DIR:
        customer.screenshot(path=os.path.join(SCREENSHOT_DIR, "customer-waiting.png"))

    agent = logged_in(chromium, f"{shop.url}/console/", "alex", "pw-x")
    expect(agent.locator("#inbox-table")).to_contain_text("waiting for a person")
    expect(agent).to_have_title(re.compile(r"^\(1\) "))  # seen from another tab: one chat waits
    expect(customer.locator("#person-status")).to_contain_text("number 1 in line")  # alex's console is open now
    expect(agent.locator("#inbox-table tbody tr")).to_have_count(1)  # the page load made one chat, not two
    agent.locator("#inbox-table [role=gridcell]", has_text="login:cara").click()  # a click on its row opens the chat
    expect(agent.locator("#inbox-chat")).to_contain_text("tent arrived torn")
    expect(agent.locator("#inbox-state")).to_contain_text("waiting for a person")
    assert agent.locator("#assistants").count() == 0 or not agent.locator("#assistants").is_visible()
    take_and_reply(agent, "tent arrived torn", "Hi, I'm Alex. I have sent you a return label.")
    expect(agent.locator("#inbox-chat")).to_contain_text("return label")
    expect(agent).not_to_have_title(re.compile(r"^\("))  # taken: nothing waits

    expect(customer.locator("#chatbot")).to_contain_text("return label")  # no reload: the open tab polls
    expect(customer.locator("#person-status")).to_contain_text("chatting with alex")
    expect(customer.locator("#back-to-assistant")).to_be_hidden()  # alex has it now
    if SCREENSHOT_DIR:
        customer.screenshot(path=os.path.join(SCREENSHOT_DIR, "customer-with-agent.png"))
        agent.screenshot(path=os.path.join(SCREENSHOT_DIR, "console-inbox.png"))
    agent.locator("#inbox-hand-back").click()
    expect(agent.locator("#inbox-state")).to_contain_text("with the assistant")
    expect(customer.locator("#person-status")).to_be_hidden()
    customer.locator("#msg textarea").click()
    customer.keyboard.type("Thanks! Refund it to 4111 1111 1111 1111, how long does it take?")
    customer.keyboard.press("Enter")
    expect(customer.locator("#chatbot [data-testid='user']").last).to_contain_text("•••• •••• •••• 1111")
    expect(customer.locator("#chatbot [data-testid='bot']")).to_have_count(2)  # the model answers again
    expect(customer.locator("#chatbot [data-testid='bot']").last).not_to_contain_text("typing")
    expect(customer.locator("#chatbot")).not_to_contain_text("4111 1111")  # masked as sent, and as stored

    find = agent.locator("#inbox-find textarea, #inbox-find input").first
    find.click()
    agent.keyboard.type("no such words")
    agent.keyboard.press("Enter")
    expect(agent.locator("#inbox-table tbody tr")).to_have_count(0)
    find.fill("")
    agent.keyboard.type("Refund it to")
    agent.keyboard.press("Enter")
    expect(agent.locator("#inbox-table")).to_contain_text("•••• •••• •••• 1111")  # the message that holds the words


def test_the_korean_page_works_end_to_end_and_switches_to_english(shop, chromium):
    from playwright.sync_api import expect

    # a customer of their own: cara's chat may still be writing the last test's reply ("already answering")
    page = logged_in(chromium, f"{shop.url}/chat/support/", "min", "pw-m", locale="ko-KR", width=390, height=844)
    expect(page.locator("#send")).to_have_text("보내기")
    expect(page.locator("#talk-to-person")).to_have_text("상담원 연결")
    page.locator("#msg textarea").fill("가나다 " * 3000)  # past the model's context: refused, in Korean
    page.keyboard.press("Enter")
    expect(page.locator("[data-testid='toast-text']")).to_contain_text("토큰")
    assert axe_violations(page) == []  # with the toast on screen: its header is no button around its close button
    page.locator("[data-testid='toast-close']").click()
    page.locator("#msg textarea").fill("")
    page.keyboard.type("텐트가 찢어져서 왔어요")
    page.keyboard.press("Enter")
    expect(page.locator("#chatbot [data-testid='bot']").last).to_be_visible()  # the assistant answered
    expect(page.locator("#chatbot [data-testid='user']").last).to_contain_text("텐트가 찢어져서 왔어요")
    page.locator("#talk-to-person").click()
    expect(page.locator("#person-status")).to_contain_text("대기 순서")
    assert page.locator("#skip-to-message").text_content() == "메시지 입력으로 건너뛰기"  # the skip link in Korean
    assert axe_violations(page) == []
    if SCREENSHOT_DIR:
        page.screenshot(path=os.path.join(SCREENSHOT_DIR, "customer-korean.png"))
    page.locator("#language").click()  # the switch: English, remembered
    expect(page.locator("#send")).to_have_text("Send")
    expect(page.locator("#person-status")).to_contain_text("in line")
    page.locator("#back-to-assistant").focus()  # changed their mind, with the keyboard
    page.keyboard.press("Enter")
    expect(page.locator("#person-status")).to_be_hidden()
    expect(page.locator("#back-to-assistant")).to_be_hidden()
    expect(page.locator("#talk-to-person")).to_be_visible()
    page.locator("#msg textarea").click()
    page.keyboard.type("Never mind, thank you")
    page.keyboard.press("Enter")
    expect(page.locator("#chatbot [data-testid='bot']")).to_have_count(2)  # the assistant answers again


def test_the_chat_works_inside_another_sites_frame_only_when_allowed(tiny_chat_model, tmp_path, chromium):
    """A shop page on another origin frames /chat/support: shown when --frame-ancestors lists the
    shop, refused by the browser when it does not (no login: a visitor, as on a shop's site)."""
    import functools
    import http.server
    import threading

    from playwright.sync_api import expect

    site = tmp_path / "shop-site"
    site.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    shop_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    shop_origin = f"http://127.0.0.1:{shop_server.server_port}"
    threading.Thread(target=shop_server.serve_forever, daemon=True).start()
    try:
        for allowed in (True, False):
            args = parse_args(["--db", str(tmp_path / f"chat-{allowed}.db"), "--model", tiny_chat_model, "--dtype",
                               "float32", "--num-kv-blocks", "128", *(["--frame-ancestors", shop_origin] * allowed)])
            app, llm = build_app(args)
            with LiveServer(llm, app) as chat_server:
                page = chromium.new_context(viewport={"width": 800, "height": 900}).new_page()
                page.set_default_timeout(120_000)
                (site / "shop.html").write_text(f"<h1>Our shop</h1><iframe id='chat' src='{chat_server.url}"
                                                f"/chat/support/' style='width:420px;height:700px'></iframe>")
                page.goto(f"{shop_origin}/shop.html")
                frame = page.frame_locator("#chat")
                if allowed:
                    expect(frame.locator("#msg textarea")).to_be_visible()
                    frame.locator("#msg textarea").click()
                    page.keyboard.type("Hello from the shop page")
                    page.keyboard.press("Enter")
                    expect(frame.locator("#chatbot [data-testid='user']")).to_contain_text("Hello from the shop page")
                else:
                    response = httpx_get(f"{chat_server.url}/chat/support/")
                    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
                    page.wait_for_load_state("load")
                    assert page.frames[-1].url.startswith("chrome-error://")  # the browser refused to show it
                page.context.close()
    finally:
        shop_server.shutdown()


def httpx_get(url: str):
    import httpx

    return httpx.get(url)


@pytest.mark.slow
def test_a_waiting_chat_is_still_waiting_after_kill_9_and_an_agent_answers_it(tiny_chat_model, tmp_path, chromium):
    """The app as a real process: a customer asks for a person, the process is killed with SIGKILL and
    started again on the same address; the customer's reloaded page still shows their place in line
    (the model stays quiet), and an agent takes the chat from the inbox and answers it."""
    import signal
    from urllib.parse import urlparse

    from playwright.sync_api import expect

    from tests.serving import start_process

    argv = ["app.py", "--db", str(tmp_path / "chat.db"), "--model", tiny_chat_model, "--dtype", "float32",
            "--num-kv-blocks", "256", "--auth-file", logins_file(tmp_path, cara="pw-c", alex="pw-x"),
            "--agent", "alex"]
    proc, url = start_process(argv)
    try:
        customer = logged_in(chromium, f"{url}/chat/support/", "cara", "pw-c", width=390, height=844)
        customer.locator("#msg textarea").click()
        customer.keyboard.type("My stove leaks gas, I want to talk to a person")
        customer.keyboard.press("Enter")
        expect(customer.locator("#person-status")).to_contain_text("(number 1)")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc, url = start_process(argv, port=urlparse(url).port)

        # the logins lived in the killed process: the page, opened again, asks again. Chromium may be swapping
        # the page to its error page for the dead server at this moment ("not attached"): then once more
        from playwright.sync_api import Error as PageError
        for attempt in range(3):
            try:
                customer.goto(f"{url}/chat/support/")
                break
            except PageError:
                if attempt == 2:
                    raise
        customer.locator("input[type=password]").wait_for()
        customer.locator("input:not([type=password])").first.fill("cara")
        customer.locator("input[type=password]").fill("pw-c")
        customer.keyboard.press("Enter")
        expect(customer.locator("#person-status")).to_contain_text("(number 1)")
        expect(customer.locator("#chatbot [data-testid='user']")).to_contain_text("stove leaks gas")
        expect(customer.locator("#chatbot [data-testid='bot']")).to_have_count(0)  # the model stayed quiet

        agent = logged_in(chromium, f"{url}/console/", "alex", "pw-x")
        expect(agent.locator("#inbox-table")).to_contain_text("waiting for a person")
        take_and_reply(agent, "stove leaks gas", "Please leave the tent and close the valve; I am sending a "
                                                 "replacement.")
        expect(customer.locator("#chatbot")).to_contain_text("close the valve")
        expect(customer.locator("#person-status")).to_contain_text("chatting with alex")
    finally:
        proc.kill()
        proc.wait(30)
