"""The operator's downloads (rated replies as CSV or JSONL, analytics as CSV), made on request at
/console/export/<name> by a route that checks who asks: an operator logged in on any page of
ours (Gradio's login cookie) or an operator's API key. They are never Gradio cache files, which
anyone logged in could fetch with the URL. The pages show plain links to this route."""
from __future__ import annotations

import html
import json

import gradio as gr
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from server.auth import Credentials
from storage import StoreUnavailable, analytics, retention
from ui import transfer

PREFIX = "/console/export"
TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson; charset=utf-8",
         "json": "application/json; charset=utf-8"}


def page_logins(app: FastAPI, request: Request) -> set[str]:
    """The names Gradio's login cookies carry for the pages mounted on `app` (each page keeps its own
    logins under its own cookie name)."""
    names = set()
    for route in app.routes:
        page = getattr(route, "app", None)
        if isinstance(page, gr.routes.App):
            for cookie in (f"access-token-{page.cookie_id}", f"access-token-unsecure-{page.cookie_id}"):
                name = page.tokens.get(request.cookies.get(cookie, ""))
                if name:
                    names.add(name)
    return names


def body(store, name: str, days: int, who: str = "") -> str | None:
    """The file `name`, made now; None if there is no such download (or no such customer)."""
    if name == "customer.json":  # an access request: everything stored of one customer
        user = retention.resolve(store, who)
        return json.dumps(retention.customer_data(store, user), ensure_ascii=False, indent=1) if user else None
    if name == "analytics.csv":
        return transfer.csv_text(analytics.COLUMNS, analytics.daily(store, days))
    rows = transfer.feedback_rows(store.rated_replies()) if name.startswith("feedback.") else None
    if name == "feedback.csv":
        return transfer.feedback_csv(rows)
    if name == "feedback.jsonl":
        return transfer.feedback_jsonl(rows)
    return None


def add_route(app: FastAPI, store, credentials: Credentials) -> None:
    """GET /console/export/{name}?days=N. Add it before the console is mounted (the first route wins)."""

    def download(name: str, request: Request, days: int = 30, who: str = "") -> Response:
        asking = page_logins(app, request) | {credentials.key_name(request.headers.get("authorization"))}
        if not asking & set(credentials.operators):
            known = bool(asking - {None})
            return PlainTextResponse("Only operators can download this: log in to /console with an operator's "
                                     "name (--admin)." if known else "Log in to /console as an operator first.",
                                     status_code=403 if known else 401)
        try:
            text = body(store, name, analytics.day_range(days), who)
        except StoreUnavailable as e:
            return PlainTextResponse(f"The database cannot be read just now: {e}", status_code=503)
        if text is None:
            return PlainTextResponse(f"No customer {who!r}." if name == "customer.json" else
                                     f"No download named {name!r}: feedback.csv, feedback.jsonl, analytics.csv or "
                                     "customer.json?who=...", status_code=404)
        return Response(text, media_type=TYPES[name.rpartition(".")[2]],
                        headers={"Content-Disposition": f'attachment; filename="{name}"', "Cache-Control": "no-store"})

    app.add_api_route(PREFIX + "/{name}", download, methods=["GET"], include_in_schema=False)


def links(*files: tuple[str, str]) -> str:
    """Download links for the page, as (label, file name with its query) pairs."""
    return " ".join(f'<a class="download-link" href="{PREFIX}/{html.escape(file)}" download>{html.escape(label)}</a>'
                    for label, file in files)


def analytics_link(days) -> str:
    return links(("Download CSV", f"analytics.csv?days={analytics.day_range(days)}"))
