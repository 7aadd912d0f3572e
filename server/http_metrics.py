"""The API's requests in Prometheus, under the names vLLM's server exports them (through
prometheus-fastapi-instrumentator): `http_requests_total{handler, method, status}` with the status
grouped ("2xx", "4xx", "5xx") and `http_request_duration_seconds{handler, method}`, a streamed
response timed to its last byte. `handler` is the route's template (`/v1/responses/{response_id}`),
or "none" for a path no route serves, so unknown paths cannot grow the series. The chat pages'
own traffic (Gradio's queue and polling) is not counted: only the API's paths."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from server.middleware import API_PATHS, PROBE_PATHS

# The routes served to operators and programs (the chat pages mounted beside them are not).
COUNTED = (*API_PATHS, *PROBE_PATHS, "/reset_prefix_cache")
UNMATCHED = "/v1/{rest:path}"  # the catch-all that refuses unknown /v1 paths
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class HTTPMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("http_requests_total", "API requests by route, method and status class",
                                ["handler", "method", "status"], registry=self.registry)
        self.duration = Histogram("http_request_duration_seconds", "API request time, to the response's last byte",
                                  ["handler", "method"], buckets=BUCKETS, registry=self.registry)

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler, method, f"{status // 100}xx").inc()
        self.duration.labels(handler, method).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """Times each API request from its arrival to its response's end (a disconnect ends it too)."""

    def __init__(self, app, metrics: HTTPMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(COUNTED):
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, watched)
        finally:
            route = getattr(scope.get("route"), "path", None)
            handler = route if route and route != UNMATCHED else "none"
            self.metrics.observe(handler, scope["method"], status, time.perf_counter() - started)
