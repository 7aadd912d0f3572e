"""pagedchat: the browser chat (Gradio, at /) and the OpenAI-compatible API (at /v1), one process,
one port, the inference engine inside.

    python app.py                              # http://127.0.0.1:7860
    python app.py --db chats.db --auth alice:secret --model path/to/model.gguf
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import engine  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from engine.config import add_engine_args, config_from_args
from engine.logs import add_logging_args, setup_logging
from storage import Store, StoreError

log = logging.getLogger("pagedchat.app")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pagedchat: browser chat + OpenAI API with an in-process engine")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 only inside a container)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--db", default="pagedchat.db", help="SQLite file for users, chats and messages")
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASSWORD",
                   help="require a login (repeatable); without it each browser is its own user")
    p.add_argument("--secret", default=os.environ.get("PAGEDCHAT_SECRET"),
                   help="signs the per-browser user id (default: one made once and kept in the database)")
    p.add_argument("--models", action="append", default=[], metavar="PATH",
                   help="extra models (folders or .gguf files) offered in the UI's model switcher")
    p.add_argument("--api-key", default=None, help="require this Bearer token on /v1")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--engine-url", default=None, metavar="URL",
                   help="UI tier only: use the OpenAI API of engine pods at URL (e.g. http://engine:8000/v1) "
                        "instead of an engine in this process")
    add_logging_args(p)
    return p.parse_args(argv)


def build_app(args: argparse.Namespace):
    """FastAPI with the API routes first, then the Gradio UI mounted at / (routes added first win)."""
    import gradio as gr

    from engine.async_engine import AsyncLLM
    from engine.server import create_app
    from ui.app import build_ui

    store = Store(args.db)
    users = []
    for item in args.auth:
        name, sep, password = item.partition(":")
        if not sep or not name or not password:
            raise ValueError(f"--auth takes USER:PASSWORD, got {item!r}")
        users.append((name, password))
    config = config_from_args(args)
    if args.engine_url:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        from engine.remote_engine import RemoteLLM

        llm = RemoteLLM(args.engine_url, config, api_key=args.api_key)
        api = FastAPI(docs_url=None, redoc_url=None)
        api.get("/health")(lambda: JSONResponse({"status": llm.state}, status_code=200 if llm.ready else 503))
    else:
        llm = AsyncLLM(config)
        api = create_app(llm, api_key=args.api_key, served_model_name=args.served_model_name,
                         log_text=args.log_message_text)
    models = {"SmolLM2-135M-Instruct (embedded)" if config.model is None else os.path.basename(config.model):
              config.model}
    for path in args.models:
        models.setdefault(os.path.basename(os.path.normpath(path)), path)
    demo = build_ui(llm, store, models=models, secret=args.secret or store.secret())
    app = gr.mount_gradio_app(api, demo, path="/", auth=users or None, footer_links=[], run_history=False)
    return app, llm


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    setup_logging(args.log_format)
    try:
        app, llm = build_app(args)
    except (StoreError, ValueError) as e:
        print(f"pagedchat: {e}", file=sys.stderr)
        return 2
    log.info("serving the chat at http://%s:%d/ and the API at /v1 (the model loads in the background)",
             args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
