"""ASGI middleware: X-Request-Id, a request-size limit applied before parsing (the API), the
visitor cookie (the chat page), who may frame the pages, and unknown assistants' addresses."""
from __future__ import annotations

import html
import json
from http.cookies import SimpleCookie

from server.auth import VISITOR_COOKIE, VisitorCookie
from server.errors import shaped
from server.replies import new_id

API_PATHS = ("/v1/", "/tokenize", "/detokenize")  # the Gradio UI mounted beside it has its own limits
PROBE_PATHS = ("/health", "/ping", "/version", "/metrics")  # for operators' tools: no visitor cookie


def request_cookies(scope) -> SimpleCookie:
    """The request's cookies (a malformed Cookie header counts as none)."""
    jar = SimpleCookie()
    for name, value in scope["headers"]:
        if name == b"cookie":
            try:
                jar.load(value.decode("latin-1"))
            except Exception:  # noqa: BLE001
                pass
    return jar


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
            return await self._refuse(scope, send)
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
                await self._refuse(scope, send)

    async def _refuse(self, scope, send) -> None:
        body = json.dumps(shaped(scope["path"], f"The request body is over the server's limit of {self.limit} bytes.",
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

    def __init__(self, app, cookie: VisitorCookie, secure: bool = False, embedded: bool = False) -> None:
        """embedded: the chat is framed by other sites (--frame-ancestors), whose frames send only
        SameSite=None cookies, and browsers take those only when Secure (HTTPS, or localhost)."""
        self.app, self.cookie, self.secure, self.embedded = app, cookie, secure or embedded, embedded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith((*API_PATHS, *PROBE_PATHS)):
            return await self.app(scope, receive, send)
        jar = request_cookies(scope)
        if VISITOR_COOKIE in jar and self.cookie.visitor(jar[VISITOR_COOKIE].value):
            return await self.app(scope, receive, send)
        value = self.cookie.issue()
        headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
        others = "; ".join(f"{k}={m.value}" for k, m in jar.items() if k != VISITOR_COOKIE)
        headers.append((b"cookie", f"{others + '; ' if others else ''}{VISITOR_COOKIE}={value}".encode()))
        set_cookie = (f"{VISITOR_COOKIE}={value}; Path=/; HttpOnly; SameSite={'None' if self.embedded else 'Lax'}; "
                      f"Max-Age=31536000"
                      f"{'; Secure' if self.secure else ''}").encode()

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", set_cookie)]}
            await send(message)

        await self.app({**scope, "headers": headers}, receive, send_with_cookie)


class FrameAncestorsMiddleware:
    """Who may show these pages in a frame: the `--frame-ancestors` origins, else nobody
    (Content-Security-Policy frame-ancestors, and X-Frame-Options DENY for older browsers)."""

    def __init__(self, app, origins: list[str]) -> None:
        self.app = app
        policy = f"frame-ancestors {' '.join(origins) if origins else chr(39) + 'none' + chr(39)}"
        self.headers = [(b"content-security-policy", policy.encode())]
        if not origins:
            self.headers.append((b"x-frame-options", b"DENY"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_policy(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, send_with_policy)


class KnownAssistantsMiddleware:
    """/chat/<assistant>/... for an assistant that does not exist: a 404 page that says so (and
    where the shop's chat is), before Gradio serves an empty page."""

    def __init__(self, app, known, default: str) -> None:
        self.app, self.known, self.default = app, known, default

    async def __call__(self, scope, receive, send):
        parts = scope["path"].split("/", 3) if scope["type"] == "http" else []
        if len(parts) < 3 or parts[1] != "chat" or not parts[2] or self.known(parts[2]):
            return await self.app(scope, receive, send)
        where, chat = f"<code>/chat/{html.escape(parts[2])}</code>", f"<a href=\"/chat/{self.default}/\">"
        korean = dict(scope["headers"]).get(b"accept-language", b"").lower().startswith(b"ko")
        body = (f"<!doctype html><meta charset=utf-8><title>상담 없음</title><p>{where}에는 상담 창구가 없습니다. "
                f"{chat}상담으로 가기</a>." if korean else
                f"<!doctype html><meta charset=utf-8><title>No such chat</title><p>There is no assistant at {where}. "
                f"{chat}Go to the chat</a>.").encode()
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class LanguageCookieMiddleware:
    """The page's language switch: a `pagedchat_lang` cookie (en or ko) becomes the request's
    Accept-Language, which the chat's own messages follow, and a page's navigator.language, which
    Gradio's translations follow (a script put first in the page's head, before Gradio starts)."""

    def __init__(self, app, cookie: str, languages: tuple[str, ...]) -> None:
        self.app, self.cookie, self.languages = app, cookie, languages

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        jar = request_cookies(scope)
        chosen = jar[self.cookie].value if self.cookie in jar else None
        if chosen not in self.languages:
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"accept-language"]
        scope = {**scope, "headers": [*headers, (b"accept-language", chosen.encode())]}
        if scope["type"] != "http" or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        script = (f"<script>Object.defineProperty(navigator,'language',{{get:()=>'{chosen}'}});"
                  f"Object.defineProperty(navigator,'languages',{{get:()=>['{chosen}']}});</script>").encode()
        start, chunks = None, []

        async def send_with_script(message):
            nonlocal start
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", [])).get(b"content-type", b"")
                if not kind.startswith(b"text/html"):
                    return await send(message)
                start = message
                return None
            if start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            body = b"".join(chunks).replace(b"<head>", b"<head>" + script, 1)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_with_script)
