"""Soak run: the real app (`python app.py`, a subprocess) under a mixed, hostile load for a while.

    python -m bench.soak                      # 64 chats for 10 minutes
    python -m bench.soak --chats 16 --minutes 1

Three quarters of the chats go through the API (the official `openai` client, streaming and not, each
API user with its own key), a quarter through the chat page's own API (gradio_client, logged in).
Mixed in: clients that drop a stream mid-reply, a stream of malformed requests, a greedy key far
over the per-user cap, and an operator resetting the prefix cache every minute. It reports errors
to good requests (should be 0), leaked KV blocks once everything is done (0), RSS growth, and TTFT.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai

from server.auth import hash_password
from ui.simulate import CUSTOMER_SERVICE_PROMPT, user_turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_USER = 4
BAD_REQUESTS = [  # (path, raw body): each must get a 4xx, never a 5xx
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [], "max_tokens": 5}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1180591620717411303424}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 999999999}'),
    ("/v1/completions", b'{"prompt": [99999999], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"1": 5}}'),
    ("/v1/completions", b'\xff\xfe not json'),
    ("/v1/models/none", b""),
]


class Tally:
    def __init__(self) -> None:
        self.good = self.errors = self.dropped = self.refused_bad = self.over_limit = self.resets = 0
        self.ttfts: list[float] = []
        self.error_samples: list[str] = []

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(what[:300])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def metric(text: str, name: str, label: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*{label}[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def api_chat(i: int, key: str, url: str, model: str, deadline: float, tally: Tally) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    rng, session = random.Random(i), 0
    while time.monotonic() < deadline:
        messages = [{"role": "system", "content": CUSTOMER_SERVICE_PROMPT}]
        for text in user_turns(i * 1000 + session, 3):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": text})
            start, drop = time.monotonic(), rng.random() < 0.1
            try:
                if rng.random() < 0.7:
                    reply, n = "", 0
                    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=64,
                                                                  stream=True)
                    async for chunk in stream:
                        delta = chunk.choices[0].delta.content if chunk.choices else None
                        if delta:
                            if not reply:
                                tally.ttfts.append(time.monotonic() - start)
                            reply, n = reply + delta, n + 1
                        if drop and n >= 3:
                            await stream.close()  # the client walks away mid-reply
                            tally.dropped += 1
                            break
                    if drop:
                        break
                else:
                    done = await client.chat.completions.create(model=model, messages=messages, max_tokens=64)
                    reply = done.choices[0].message.content
                messages.append({"role": "assistant", "content": reply})
                tally.good += 1
            except Exception as e:  # noqa: BLE001 - every failure of a good request is counted
                tally.error(f"api chat {i}: {type(e).__name__}: {e}")
                break
        session += 1


def ui_chat(i: int, url: str, password: str, deadline: float, tally: Tally) -> None:
    from gradio_client import Client

    try:
        client = Client(f"{url}/chat/support/", auth=(f"user{i}", password), verbose=False)  # the customer chat
    except Exception as e:  # noqa: BLE001
        tally.error(f"ui login {i}: {e}")
        return
    session = 0
    while time.monotonic() < deadline:
        client.predict(api_name="/new_chat")
        for text in user_turns(50_000 + i * 1000 + session, 3):
            if time.monotonic() >= deadline:
                return
            try:
                chat, box = client.predict(text, api_name="/send")  # the assistant's own sampling
                if box or not chat or chat[-1]["role"] != "assistant":
                    raise RuntimeError(f"the turn came back unsent: {box!r}")
                tally.good += 1
            except Exception as e:  # noqa: BLE001
                tally.error(f"ui chat {i}: {type(e).__name__}: {e}")
        session += 1


async def bad_requests(url: str, key: str, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < deadline:
            for path, body in BAD_REQUESTS:
                r = await http.request("GET" if not body else "POST", f"{url}{path}", content=body,
                                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
                if 400 <= r.status_code < 500 and r.headers.get("content-type", "").startswith("application/json") \
                        and "error" in r.json():
                    tally.refused_bad += 1
                else:
                    tally.error(f"bad request {path} {body[:40]!r} got {r.status_code}: {r.text[:100]}")
            await asyncio.sleep(1)


async def greedy(url: str, key: str, deadline: float, tally: Tally) -> None:
    """One key asking for 3x its cap at once, again and again: 429s for it, nobody else slowed to errors."""
    async with httpx.AsyncClient(timeout=600) as http:
        async def one():
            r = await http.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"prompt": "Write a long poem about tents.", "max_tokens": 32})
            if r.status_code == 429 and r.headers.get("retry-after"):
                tally.over_limit += 1
            elif r.status_code != 200:
                tally.error(f"greedy got {r.status_code}: {r.text[:100]}")
        while time.monotonic() < deadline:
            await asyncio.gather(*(one() for _ in range(3 * PER_USER)))


async def operator(url: str, key: str, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(60, max(deadline - time.monotonic(), 0)))
            r = await http.post(f"{url}/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200:
                tally.resets += 1
            else:
                tally.error(f"operator reset got {r.status_code}: {r.text[:100]}")


async def run(url: str, chats: int, seconds: float, keys: dict[str, str], password: str, pid: int) -> dict:
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {keys['ops']}"}).json()["data"][0]["id"]
    tally, deadline = Tally(), time.monotonic() + seconds
    n_ui = chats // 4
    rss_start = rss_mib(pid)
    # two API chats per key: each key stays under its cap (the greedy key is the one over it)
    tasks = [api_chat(i, keys[f"api{i // 2}"], url, model, deadline, tally) for i in range(chats - n_ui)]
    tasks += [asyncio.to_thread(ui_chat, i, url, password, deadline, tally) for i in range(n_ui)]
    tasks += [bad_requests(url, keys["api0"], deadline, tally), greedy(url, keys["greedy"], deadline, tally),
              operator(url, keys["ops"], deadline, tally)]
    started = time.monotonic()
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    headers = {"Authorization": f"Bearer {keys['ops']}"}
    for _ in range(120):  # everything stopped: the pool must drain to no used block
        text = httpx.get(f"{url}/metrics", headers=headers).text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "pagedchat:kv_blocks", 'state="used"') == 0:
            break
        await asyncio.sleep(0.5)
    return dict(tally=tally, elapsed=elapsed, rss_start=rss_start, rss_end=rss_mib(pid),
                leaked=metric(text, "pagedchat:kv_blocks", 'state="used"'))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--app-args", default="", help="extra flags for app.py, e.g. '--model PATH'")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="pagedchat-soak-")
    password = "soak-password"
    keys = {f"api{i}": f"sk-api{i}-{os.urandom(6).hex()}" for i in range(args.chats // 2 + 1)}
    keys.update(greedy=f"sk-greedy-{os.urandom(6).hex()}", ops=f"sk-ops-{os.urandom(6).hex()}")
    with open(os.path.join(folder, "keys.txt"), "w") as f:
        f.writelines(f"{name}:{key}\n" for name, key in keys.items())
    with open(os.path.join(folder, "logins.txt"), "w") as f:
        f.writelines(f"user{i}:{hash_password(password)}\n" for i in range(args.chats // 4))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "app.py", "--port", str(port), "--db", os.path.join(folder, "chat.db"),
           "--api-key-file", os.path.join(folder, "keys.txt"), "--auth-file", os.path.join(folder, "logins.txt"),
           "--admin", "ops", "--max-concurrent-per-user", str(PER_USER), *args.app_args.split()]
    app = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "app.log"), "w"))
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if app.poll() is not None:
                raise SystemExit(f"the app exited; see {folder}/app.log")
            time.sleep(0.5)
        result = asyncio.run(run(url, args.chats, args.minutes * 60, keys, password, app.pid))
    finally:
        app.terminate()
        app.wait(timeout=60)
    t = result["tally"]
    ttfts = sorted(t.ttfts)
    pct = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan"))
    print(f"soak: {args.chats} chats for {result['elapsed'] / 60:.1f} min through the API and the chat page")
    print(f"  good turns {t.good} · errors to good requests {t.errors} · streams dropped by clients {t.dropped}")
    print(f"  bad requests refused (4xx) {t.refused_bad} · over-limit refusals (429) {t.over_limit} · "
          f"prefix-cache resets {t.resets}")
    print(f"  KV blocks still used at the end {result['leaked']:.0f} · RSS {result['rss_start']:.0f} -> "
          f"{result['rss_end']:.0f} MiB ({result['rss_end'] - result['rss_start']:+.0f})")
    print(f"  API streaming TTFT p50 {pct(0.5):.2f} s · p95 {pct(0.95):.2f} s "
          f"(median of {len(ttfts)}: {statistics.median(ttfts) if ttfts else float('nan'):.2f} s)")
    for sample in t.error_samples:
        print("  error:", sample)
    return 1 if t.errors or result["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
