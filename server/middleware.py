"""ASGI middleware of the API: X-Request-Id, and a request-size limit applied before parsing."""
from __future__ import annotations

import json

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
