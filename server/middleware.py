"""X-Request-Id: accepted (or made), kept on the request for the logs, echoed on the response."""
from __future__ import annotations

from server.protocol import new_id


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
