"""Scale-out run for real: two engine servers (`python -m server`) behind Debian's nginx hashing
X-Session-Id consistently, and the UI tier (`app.py --engine-url`, no engine of its own) in front.
A chat's turns stay on one engine (its history is a prefix-cache hit there), chats spread over both,
and killing an engine mid-reply keeps what was written, says so, and the chat goes on on the other."""
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from gradio_client import Client

from app import build_app, parse_args
from storage import Store
from tests.serving import LiveServer, logins_file, wait_for

LEFT_AS_IS = {"__type__": "update"}  # /send's box output when the message was sent (refused: the text)

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGINX = os.path.join(ROOT, ".tools", "nginx", "usr", "sbin", "nginx")  # Debian's, unpacked by `make tools`
NGINX_CONF = """
{user}
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
    upstream engines {{
        hash $http_x_session_id consistent;
        server 127.0.0.1:{a} max_fails=1 fail_timeout=60s;
        server 127.0.0.1:{b} max_fails=1 fail_timeout=60s;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_next_upstream error timeout http_502;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def cluster(tiny_chat_model, tmp_path_factory):
    if not os.path.exists(NGINX):
        pytest.fail("nginx is not unpacked (`make tools` puts Debian's nginx in .tools/nginx)")
    folder = tmp_path_factory.mktemp("scale-out")
    ports = [free_port() for _ in range(3)]
    engines = {port: subprocess.Popen([sys.executable, "-m", "server", "--model", tiny_chat_model, "--dtype", "float32",
                                       "--num-kv-blocks", "512", "--port", str(port), "--max-concurrent-per-user", "0",
                                       "--kv-disk", str(folder / "kv")],  # one disk tier, shared
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for port in ports[:2]}
    conf = folder / "nginx.conf"
    conf.write_text(NGINX_CONF.format(user="user root;" if os.geteuid() == 0 else "", dir=folder, a=ports[0],
                                      b=ports[1], port=ports[2]))
    nginx = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(folder), "-g", "daemon off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for port in engines:
            wait_for(lambda: healthy(f"http://127.0.0.1:{port}"), 120, f"engine {port}")
        proxy = f"http://127.0.0.1:{ports[2]}"
        wait_for(lambda: healthy(proxy), 30, "nginx")
        db = str(folder / "ui.db")
        app, client = build_app(parse_args(["--demo", "--db", db, "--model", tiny_chat_model, "--engine-url", f"{proxy}/v1",
                                            "--auth-file", logins_file(folder, carol="pw-c")]))
        with LiveServer(client, app) as ui:
            ui.store, ui.engines = Store(db), engines
            yield ui
    finally:
        nginx.terminate()
        for proc in engines.values():
            proc.kill()
        nginx.wait(30)


def metric(port: int, name: str) -> float:
    """One series of an engine's own /metrics, summed over its labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def served(port: int) -> float:
    return metric(port, "vllm:request_success_total")


def running(port: int) -> float:
    return metric(port, "vllm:num_requests_running")


def test_chats_stick_to_one_engine_and_spread_over_both(cluster):
    carol = Client(cluster.url, auth=("carol", "pw-c"), verbose=False)
    sessions = []
    for i in range(10):
        carol.predict("", api_name="/new_chat")
        carol.predict(f"Hello, this is chat {i}. Where is my parcel?", 0.0, 1.0, 16, api_name="/send")
        carol.predict("And when will it arrive?", 0.0, 1.0, 16, api_name="/send")
        sessions.append(cluster.store.sessions("login:carol")[0]["id"])
    bs, firsts = 16, []
    for sid in sessions:
        user1, reply1, user2, reply2 = cluster.store.messages("login:carol", sid)
        history = len(user1["token_ids"]) + len(reply1["token_ids"])
        assert reply2["cached_tokens"] >= history - bs, (sid, reply2["cached_tokens"], history)
        firsts.append(user1["token_ids"])
    shared = len(os.path.commonprefix(firsts)) // bs * bs  # the system prompt, common to every chat
    # Second turns hit the same engine's pool: the shared disk tier gave at most the system prompt, once
    assert sum(metric(port, "vllm:external_prefix_cache_hits_total") for port in cluster.engines) <= shared
    counts = [served(port) for port in cluster.engines]
    assert all(c > 0 for c in counts) and sum(counts) >= 20, counts


def test_killing_an_engine_mid_reply_keeps_the_reply_and_the_chat_moves_on(cluster):
    carol = Client(cluster.url, auth=("carol", "pw-c"), verbose=False)
    carol.predict("", api_name="/new_chat")
    carol.predict("Start of a long chat.", 0.0, 1.0, 16, api_name="/send")
    sid = cluster.store.sessions("login:carol")[0]["id"]
    job = carol.submit("Tell me everything about tents.", 0.0, 1.0, 1024, api_name="/send")
    wait_for(lambda: any(running(port) > 0 for port in cluster.engines), 60, "the reply to start")
    victim = next(port for port in cluster.engines if running(port) > 0)
    wait_for(lambda: len(job.outputs()) >= 3, 60, "a few tokens of the reply")
    cluster.engines[victim].send_signal(signal.SIGKILL)
    chat, box = job.result(timeout=120)
    assert box == LEFT_AS_IS and "interrupted" in str(chat[-1]["content"])
    messages = cluster.store.messages("login:carol", sid)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1]["finish_reason"] == "interrupted" and messages[-1]["token_ids"]
    survivor = next(port for port in cluster.engines if port != victim)
    loaded_before = metric(survivor, "vllm:external_prefix_cache_hits_total")
    chat, box = carol.predict("Are you still there?", 0.0, 1.0, 16, api_name="/send")
    assert box == LEFT_AS_IS and "generated" in str(chat[-1]["content"])  # answered by the engine left
    messages = cluster.store.messages("login:carol", sid)
    assert len(messages) == 6
    first_turn = len(messages[0]["token_ids"]) + len(messages[1]["token_ids"])
    # read from the shared disk tier, not recomputed: all of the first turn's full blocks but the last, which
    # its final decode steps filled and the writer may still have held when the kill came (kill -9 loses
    # only what is queued; a faster engine reaches the kill sooner)
    assert messages[-1]["cached_tokens"] >= first_turn - 2 * 16
    assert metric(survivor, "vllm:external_prefix_cache_hits_total") > loaded_before
