"""ASGI middleware: X-Request-Id, a request-size limit applied before parsing (the API), and the
visitor cookie (the chat page)."""
from __future__ import annotations

import json
from http.cookies import SimpleCookie

from server.auth import VISITOR_COOKIE, VisitorCookie
from server.protocol import error_body, new_id

API_PATHS = ("/v1/", "/tokenize", "/detokenize")  # the Gradio UI mounted beside it has its own limits


class _TooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for an API request body over `limit` bytes, told by Content-Length or counted as it
    arrives: nothing that large is read into memory, parsed or tokenized."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PATHS):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(f"The request body is over the server's limit of {self.limit} bytes.",
                                     "invalid_request_error", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")[:128]
        rid = given or new_id("req")
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)
        await self.app(scope, receive, send_with_id)


class VisitorCookieMiddleware:
    """Gives every browser without a valid visitor cookie a new one: set on the response (HttpOnly,
    SameSite=Lax) and put into this request's own headers, so its first request already has it."""

    def __init__(self, app, cookie: VisitorCookie, secure: bool = False) -> None:
        self.app, self.cookie, self.secure = app, cookie, secure

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith((*API_PATHS, "/health", "/metrics")):
            return await self.app(scope, receive, send)
        jar = SimpleCookie()
        for name, value in scope["headers"]:
            if name == b"cookie":
                try:
                    jar.load(value.decode("latin-1"))
                except Exception:  # noqa: BLE001 - a malformed cookie header counts as none
                    pass
        if VISITOR_COOKIE in jar and self.cookie.visitor(jar[VISITOR_COOKIE].value):
            return await self.app(scope, receive, send)
        value = self.cookie.issue()
        headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
        others = "; ".join(f"{k}={m.value}" for k, m in jar.items() if k != VISITOR_COOKIE)
        headers.append((b"cookie", f"{others + '; ' if others else ''}{VISITOR_COOKIE}={value}".encode()))
        set_cookie = (f"{VISITOR_COOKIE}={value}; Path=/; HttpOnly; SameSite=Lax; Max-Age=31536000"
                      f"{'; Secure' if self.secure else ''}").encode()

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", set_cookie)]}
            await send(message)

        await self.app({**scope, "headers": headers}, receive, send_with_cookie)
