"""pagedchat: the browser chat (Gradio) and the OpenAI-compatible API (at /v1), one process, one
port. The composition root: flags -> EngineConfig -> an EngineClient (the engine in this process,
or remote engine pods with --engine-url) -> the API routes and the pages -> uvicorn.

Pages: the customer chat of each assistant at /chat/<assistant> (/ leads to the default one), the
operator console at /console; with --demo, / is the demo page instead (the live engine panel for
everyone, a chat's own system prompt and sampling).

    python app.py                              # http://127.0.0.1:7860
    python -m server.auth add-user logins.txt alice     # asks for alice's password, stores its hash
    python app.py --db chats.db --auth-file logins.txt --admin alice --model path/to/model.gguf
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from engine.checkpoint.source import DEFAULT_MODEL_NAME
from engine.client import EngineClient
from engine.fleet import ModelFleet
from engine.config import EngineConfig, add_engine_args, config_from_args, knobs
from server.auth import Credentials, VisitorCookie, read_secret
from server.customers import CustomerTokenMiddleware, CustomerTokens
from server.middleware import VisitorCookieMiddleware
from server.cli import add_server_args, credentials_from_args, limiter_from_args, serve
from server.logs import setup_logging
from storage import Store, StoreError
from storage.documents import DocumentError
from storage.knowledge import Knowledge
from storage.background import repeat
from storage.retention import start_sweeps
from ui.notify import HandoffWebhook, read_webhook

log = logging.getLogger("pagedchat.app")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pagedchat: browser chat + OpenAI API with an in-process engine")
    add_engine_args(p)
    add_server_args(p, port=7860)
    p.add_argument("--db", default="pagedchat.db", help="SQLite file for users, chats and messages")
    p.add_argument("--auth-file", default=knobs().auth_file, metavar="PATH",
                   help="logins, `NAME:scrypt$...` lines made by `python -m server.auth add-user PATH NAME`; "
                        "without logins or API keys each browser is its own visitor (a signed cookie)")
    p.add_argument("--secret-file", default=knobs().secret_file, metavar="PATH",
                   help="the key that signs visitor cookies (default: $PAGEDCHAT_SECRET, else one made once and "
                        "kept in the database)")
    p.add_argument("--cache-isolation", choices=("shared", "user"), default="shared",
                   help="'user': each user's chats reuse only their own cached prefixes (no cross-user timing "
                        "signal; costs the shared system prompt's reuse); 'shared' (default): all users share")
    p.add_argument("--models", action="append", default=[], metavar="PATH",
                   help="extra models (folders or .gguf files) offered in the UI's model switcher")
    p.add_argument("--demo", action="store_true",
                   help="serve the demo page at /: every visitor sees the live engine panel and may set a chat's own "
                        "system prompt and sampling (for demos and for watching paging and batching); without it, "
                        "/ leads to the customer chat, which shows neither")
    p.add_argument("--agent", action="append", default=[], metavar="NAME",
                   help="a person who answers chats handed over from the assistant (a login; repeatable): works the "
                        "inbox in /console, cannot switch models. Operators (--admin) can too")
    p.add_argument("--public-chat", action="store_true",
                   help="customers chat at /chat/<assistant> without a login (each browser a visitor, known by a "
                        "signed cookie) while logins and API keys still guard the console, the demo page and /v1; "
                        "without it, once any login or key exists, the chat asks for one too")
    p.add_argument("--customer-token-secret-file", default=None, metavar="PATH",
                   help="the key (32+ characters) with which the shop's site signs (JWT, HS256) the customers it "
                        "sends to the chat as /chat/<assistant>/?customer_token=...; implies --public-chat")
    p.add_argument("--handoff-webhook-file", default=None, metavar="PATH",
                   help="a file holding an incoming-webhook URL (Slack, Mattermost, Discord, or your own) to which a "
                        "JSON message is POSTed when a chat starts waiting for a person")
    p.add_argument("--frame-ancestors", nargs="*", default=[], metavar="ORIGIN",
                   help="sites that may embed the chat in an iframe (e.g. https://shop.example); default: none")
    p.add_argument("--knowledge", default=None, metavar="FOLDER",
                   help="index the documents in FOLDER (Markdown, text, HTML, PDF) as the default assistant's "
                        "knowledge at start (changed files are indexed again, unchanged ones skipped)")
    p.add_argument("--retention-days", type=positive_days, default=None, metavar="DAYS",
                   help="delete chats nobody has written to for DAYS days (and the KV disk tier's files as old), "
                        "checked at start and hourly; default: keep them")
    p.add_argument("--refresh-pages-hours", type=hours, default=24.0, metavar="H",
                   help="fetch the knowledge pages added by their address again every H hours (0: never)")
    p.add_argument("--engine-url", default=None, metavar="URL",
                   help="UI tier only: use the OpenAI API of engine pods at URL (e.g. http://engine:8000/v1) "
                        "instead of an engine in this process (--model names the same model, for its tokenizer)")
    return p.parse_args(argv)


def log_lines(what: str, lines: list[str]) -> None:
    for line in lines:
        (log.warning if line.startswith("❌") else log.info)("%s: %s", what, line)


def number_of(unit: str, zero_ok: bool):
    """An argparse type: a number of `unit` up to 100 000, above 0 (or from 0 when zero_ok)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not (0 <= number if zero_ok else 0 < number) or not number < 100_000:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of {unit} "
                                             f"{'(0: never)' if zero_ok else 'above 0'}")
        return number
    return parse


positive_days, hours = number_of("days", zero_ok=False), number_of("hours", zero_ok=True)


def make_client(config: EngineConfig, engine_url: str | None) -> EngineClient:
    """The engine in this process (loading in the background), or the remote engine pods (called with
    the key in $PAGEDCHAT_ENGINE_API_KEY, if they want one)."""
    if engine_url:
        from server.remote import RemoteLLM

        return RemoteLLM(engine_url, config.model, api_key=knobs().engine_api_key)
    from engine.async_llm import AsyncLLM

    return AsyncLLM(config)


def model_choices(config: EngineConfig, extra: list[str]) -> dict[str, str | None]:
    """The model switcher's entries, label -> model argument; the first is the one loaded."""
    first = f"{DEFAULT_MODEL_NAME} (embedded)" if config.model is None else os.path.basename(config.model)
    models = {first: config.model}
    for path in extra:
        models.setdefault(os.path.basename(os.path.normpath(path)), path)
    return models


def model_fleet(client: EngineClient, config: EngineConfig, models: dict[str, str | None], remote: bool) -> ModelFleet:
    """The engines by model: `client` first; another offered model an assistant names gets an engine
    of its own in this process, with the main one's settings but its own quantization default and no
    disk tier (the tier's folder belongs to the main engine). A UI tier on remote engines has one."""
    def start(model: str | None) -> EngineClient:
        from engine.async_llm import AsyncLLM

        return AsyncLLM(dataclasses.replace(config, model=model, quantization=None, kv_disk=None))
    return ModelFleet(client, models, None if remote else start)


def build_app(args: argparse.Namespace):
    """FastAPI with the API routes first, then the Gradio UI mounted at / (routes added first win)."""
    import gradio as gr

    from fastapi.responses import FileResponse, RedirectResponse

    from server.middleware import FrameAncestorsMiddleware, KnownAssistantsMiddleware, LanguageCookieMiddleware
    from server.routes import create_app
    from ui import assistants, downloads
    from ui.console import build_console
    from ui.i18n import I18N, LANG_COOKIE, LANGUAGES
    from ui.customer import build_customer_ui
    from ui.layout import build_ui
    from ui.page import FAVICON, assets as page_assets

    store = Store(args.db)
    cut = store.mark_interrupted()
    if cut:
        log.info("%d reply(ies) were cut by the last shutdown; they are shown as interrupted", cut)
    assistants.ensure_default(store)
    if args.knowledge:
        try:
            lines = Knowledge(store).add_folder(assistants.DEFAULT_SLUG, args.knowledge)
        except DocumentError as e:
            raise SystemExit(f"--knowledge: {e}") from None
        log_lines("knowledge", lines)
    credentials = credentials_from_args(args, args.auth_file)
    limiter = limiter_from_args(args, credentials)
    config = config_from_args(args)
    if args.retention_days:
        start_sweeps(store, args.retention_days, config.kv_disk)
    if args.refresh_pages_hours:  # the shop's pages, fetched again so answers follow the site
        every = args.refresh_pages_hours * 3600
        repeat("refresh-pages", every, lambda: log_lines("knowledge", Knowledge(store).refresh_pages()), every)
    client = make_client(config, args.engine_url)
    api = create_app(client, credentials=credentials, limiter=limiter, served_model_name=args.served_model_name,
                     log_text=args.log_message_text, max_request_bytes=args.max_request_bytes,
                     private_metrics=args.private_metrics)
    api.state.settings.health_checks["storage"] = store.health
    customers = customer_tokens(args)
    public = args.public_chat or customers is not None
    anonymous = public or not credentials.required  # customers may chat without a login
    visitors = VisitorCookie(visitor_secret(args, store)) if anonymous else None
    if visitors is not None:
        api.add_middleware(VisitorCookieMiddleware, cookie=visitors, embedded=bool(args.frame_ancestors))
    if customers is not None:
        api.add_middleware(CustomerTokenMiddleware, tokens=customers, embedded=bool(args.frame_ancestors))
    api.add_middleware(KnownAssistantsMiddleware, known=lambda slug: store.assistant(slug) is not None,
                       default=assistants.DEFAULT_SLUG)
    api.add_middleware(FrameAncestorsMiddleware, origins=args.frame_ancestors)
    api.add_middleware(LanguageCookieMiddleware, cookie=LANG_COOKIE, languages=LANGUAGES)
    api.add_api_route("/knowledge/{assistant}/{chunk_id}", knowledge_page(store), include_in_schema=False)
    models, salted = model_choices(config, args.models), args.cache_isolation == "user"
    mount = dict(auth=login(credentials), footer_links=[], run_history=False, **page_assets())
    fleet = model_fleet(client, config, models, remote=bool(args.engine_url))
    for a in store.assistants():  # the models assistants name load now, beside the main one
        fleet.client_for(a["model"])
    api.state.fleet = fleet
    api.state.settings.health_checks["models"] = fleet.problems
    api.state.others = lambda: {c.info.name: c for c in fleet.others().values() if c.info is not None}
    customer = build_customer_ui(client, store, limiter=limiter, visitors=visitors, salt_by_user=salted, fleet=fleet,
                                 staffed=bool(args.agent or credentials.operators), customers=customers,
                                 on_waiting=HandoffWebhook(read_webhook(args.handoff_webhook_file), store)
                                 if args.handoff_webhook_file else None)
    app = gr.mount_gradio_app(api, customer, path="/chat/{assistant}", i18n=I18N,
                              **{**mount, "auth": None if public else mount["auth"]})
    downloads.add_route(app, store, credentials)  # before the console's mount, which would take the path
    console = build_console(client, store, models=models, quantization=config.quantization, credentials=credentials,
                            agents=frozenset(args.agent), fleet=fleet)
    app = gr.mount_gradio_app(app, console, path="/console", **mount)
    if args.demo:
        demo = build_ui(client, store, models=models, quantization=config.quantization, credentials=credentials,
                        limiter=limiter, visitors=visitors, salt_by_user=salted)
        app = gr.mount_gradio_app(app, demo, path="/", **mount)
    else:
        app.add_api_route("/", lambda: RedirectResponse(f"/chat/{assistants.DEFAULT_SLUG}/"), include_in_schema=False)
        # every page's icon, which the browser asks the root for
        app.add_api_route("/favicon.ico", lambda: FileResponse(FAVICON, media_type="image/svg+xml"),
                          include_in_schema=False)
    return app, client


def knowledge_page(store: Store):
    """GET /knowledge/<assistant>/<chunk id>: the chunk a reply's source link names, as a page."""
    import html

    from fastapi.responses import HTMLResponse

    knowledge = Knowledge(store)

    def page(assistant: str, chunk_id: int):
        chunk = knowledge.chunk(assistant, chunk_id)
        if chunk is None:
            return HTMLResponse("<p>There is no such excerpt (the document may have changed since).</p>", 404)
        title = html.escape(chunk.document + (f" › {chunk.section}" if chunk.section else ""))
        body = "".join(f"<p>{linked(p)}</p>" for p in chunk.text.split("\n\n"))
        return HTMLResponse(f"<!doctype html><meta charset=utf-8><meta name=viewport content='width=device-width'>"
                            f"<title>{title}</title><body style='font-family:sans-serif;max-width:40em;margin:2em auto;"
                            f"padding:0 1em'><h1 style='font-size:1.2em'>{title}</h1>{body}</body>")
    return page


def linked(text: str) -> str:
    """An excerpt's paragraph as HTML: escaped, its documents' own links ([words](http...)) as links."""
    import html
    import re

    parts = re.split(r"\[([^\]\n]+)\]\(((?:https?|mailto):[^)\s]+)\)", text)
    return "".join(html.escape(part) if i % 3 == 0 else
                   f"<a href='{html.escape(parts[i + 1], quote=True)}' rel='noopener'>{html.escape(part)}</a>"
                   if i % 3 == 1 else "" for i, part in enumerate(parts))


def customer_tokens(args: argparse.Namespace) -> CustomerTokens | None:
    """The checker of the shop's customer tokens, if the shop signs its customers in."""
    if not args.customer_token_secret_file:
        return None
    secret = read_secret(args.customer_token_secret_file)
    if not secret:
        raise ValueError(f"--customer-token-secret-file: {args.customer_token_secret_file} is empty")
    return CustomerTokens(secret)


def visitor_secret(args: argparse.Namespace, store: Store) -> str:
    return read_secret(args.secret_file) or knobs().secret or store.secret()


def login(credentials: Credentials):
    """The page's login check: whatever protects the API protects the page (logins, or key name + key)."""
    return credentials.check_login if credentials.required else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_format)
    try:
        app, client = build_app(args)
    except (StoreError, OSError, ValueError) as e:
        print(f"pagedchat: {e}", file=sys.stderr)
        return 2
    log.info("serving the chat at http://%s:%d/ and the API at /v1 (the model loads in the background)",
             args.host, args.port)
    fleet = app.state.fleet
    serve(app, args.host, args.port, fleet.shutdown, drain=fleet.drain, drain_s=args.drain_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
