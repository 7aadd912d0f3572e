"""A real server on 127.0.0.1 and a free port, in a thread, for the end-to-end tests."""
from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import uvicorn

from engine.async_llm import AsyncLLM
from server.routes import create_app


class LiveServer:
    """Serves `app` (default: the API for `llm`) until the with-block ends."""

    def __init__(self, llm: AsyncLLM, app=None, **app_options) -> None:
        self.llm = llm
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # A test's browser or client may still hold a stream open when the server stops: wait 2 s, not forever.
        config = uvicorn.Config(app or create_app(llm, **app_options), log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "server start")
        if not self.llm.wait_ready(300):
            raise RuntimeError(f"engine failed to load: {self.llm.error}")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.llm.shutdown()


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll a condition until it holds (bounded); the tests' only way of waiting."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def logins_file(folder, **passwords: str) -> str:
    """An --auth-file with these logins (name=password), hashed as `python -m server.auth add-user` does."""
    from server.auth import hash_password

    path = os.path.join(str(folder), "logins.txt")
    with open(path, "w") as f:
        f.writelines(f"{name}:{hash_password(password)}\n" for name, password in passwords.items())
    return path


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_process(argv: list[str], port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`python ARGV --port P` from the repository root (app.py or -m server) on a free port (or
    `port`: a restart where the last one was), once its /health says 200. The caller kills it."""
    import httpx

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, *argv, "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"{argv[0]} exited"
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(healthy, 300, f"{argv[0]} to serve")
    return proc, url


@contextlib.contextmanager
def local_site(answer):
    """An HTTP server on 127.0.0.1 and a free port, in a thread, whose GETs and POSTs `answer(handler)` writes
    (a shop's site, an HTTP tool); yields its base address."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answer(self)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
