"""What a customer waits for, measured in Chromium against a fresh `python app.py` (a subprocess):

    python -m bench.page_timings              # the default model, 8 messages
    python -m bench.page_timings --messages 4 --model PATH

- start: seconds from the process start to the chat page served, and to the model ready (/health);
- for each message typed in the customer chat and sent with Enter: milliseconds until the message
  shows in the chat, and until the reply's first token shows (both seen in the page by a
  MutationObserver, from the keypress's own timestamp).
A benchmark, not a test: it prints numbers (medians and ranges) and the CPU they came from.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from bench.soak import free_port

CHROMIUM = "/usr/bin/chromium"  # Debian's (make browser installs it); never a downloaded browser
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

QUESTIONS = ["Where is my order NW20481377?", "How do I return a tent?", "Do you ship to Canada?",
             "My jacket's zip broke after a week.", "Can I change my delivery address?", "What are your hours?",
             "Is the 2-person tent waterproof?", "How long does a refund take?"]
WATCH = """(question) => new Promise((resolve) => {  // resolves with [shown ms, first token ms] after Enter
  const chat = document.querySelector('#chatbot'), box = document.querySelector('#msg textarea');
  const bots = () => chat.querySelectorAll("[data-testid='bot']").length, before = bots();
  let pressed = null, shown = null;
  box.addEventListener('keydown', (e) => { if (e.key === 'Enter') pressed = e.timeStamp; }, {once: true});
  const seen = new MutationObserver(() => {
    const now = performance.now(), users = [...chat.querySelectorAll("[data-testid='user']")];
    if (pressed === null) return;
    if (shown === null && users.length && users[users.length - 1].innerText.includes(question)) shown = now;
    const bot = [...chat.querySelectorAll("[data-testid='bot']")].pop();
    if (shown !== null && bots() > before && bot && bot.innerText.trim() && !bot.innerText.includes('typing')) {
      seen.disconnect(); resolve([shown - pressed, now - pressed]);
    }
  });
  seen.observe(chat, {subtree: true, childList: true, characterData: true});
})"""


def wait_until(check, limit_s: float) -> float:
    """Seconds until `check()` is true (polled every 0.1 s), or SystemExit after `limit_s`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > limit_s:
            raise SystemExit(f"gave up after {limit_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - start


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the embedded default)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    port, folder = free_port(), tempfile.mkdtemp(prefix="page-timings-")
    command = [sys.executable, "app.py", "--port", str(port), "--db", os.path.join(folder, "chat.db")]
    start = time.monotonic()
    app = subprocess.Popen(command + (["--model", args.model] if args.model else []), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(f"{base}/chat/support/"), 300)
        page_s = time.monotonic() - start
        wait_until(lambda: answers(f"{base}/health"), 600)
        ready_s = time.monotonic() - start
        shown, first = [], []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS, timeout=180_000)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(120_000)
            page.goto(f"{base}/chat/support/")
            box = page.locator("#msg textarea")
            for question in (QUESTIONS * args.messages)[:args.messages]:
                box.click()
                page.keyboard.type(question)
                page.evaluate(f"(question) => {{ window.timing = ({WATCH})(question); }}", question)
                page.keyboard.press("Enter")
                a, b = page.evaluate("window.timing")
                shown.append(a)
                first.append(b)
                page.locator("#stop").click()  # the next message need not wait for this whole reply
                page.wait_for_function("() => !document.querySelector('#chatbot').innerText.includes('typing')")
            browser.close()
    finally:
        app.terminate()
        app.wait(30)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.messages} messages in the customer chat")
    print(f"page served {page_s:.1f} s after the start; model ready {ready_s:.1f} s")
    for name, values in (("message shown", shown), ("first token shown", first)):
        print(f"{name:18s} median {statistics.median(values):6.0f} ms   range {min(values):.0f}-{max(values):.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
