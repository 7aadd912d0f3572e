"""`python -m server`: the OpenAI-compatible server alone (an engine pod), and the flags that
app.py shares with it.

    python -m server --model PATH --host 127.0.0.1 --port 8000
    from server.cli import run_server; run_server(model=..., port=8000)
"""
from __future__ import annotations

import argparse

from engine.config import EngineConfig, add_engine_args, config_from_args, knobs
from server.auth import Credentials, read_api_keys, read_users
from server.limits import UserLimiter
from server.logs import add_logging_args, setup_logging
from server.routes import MAX_REQUEST_BYTES

DEFAULT_PER_USER = 16  # requests in flight per user: a chat or two per tab, or a modest batch job


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    """Flags of every HTTP front: where to listen, who may call, the served name, logging."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 only inside a container)")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--api-key-file", default=knobs().api_key_file, metavar="PATH",
                        help="API keys, one `NAME:KEY` per line; with any key (or $PAGEDCHAT_API_KEY) every "
                             "call needs `Authorization: Bearer KEY`")
    parser.add_argument("--admin", action="append", default=[], metavar="NAME",
                        help="an operator: a login or an API key's name (repeatable). Operators switch models, "
                             "simulate load, reset the prefix cache, review ratings, and are not capped")
    parser.add_argument("--max-concurrent-per-user", type=int, default=DEFAULT_PER_USER, metavar="N",
                        help="requests in flight per user / key / address; over it: 429 + Retry-After "
                             f"(0: no cap; default {DEFAULT_PER_USER})")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help="API request bodies over this get 413 before they are parsed")
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_S, metavar="S",
                        help="on SIGTERM: refuse new requests, let those in flight go on for S seconds, then end "
                             "them (finish_reason \"abort\"; chat replies stored as interrupted), exit 0")
    parser.add_argument("--private-metrics", action="store_true",
                        help="/metrics needs an API key like /v1 (Prometheus: bearer_token). Off: open, for a scraper "
                             "inside the cluster; keep it off a public ingress")
    add_logging_args(parser)


def credentials_from_args(args: argparse.Namespace, auth_file: str | None = None) -> Credentials:
    return Credentials(keys=read_api_keys(args.api_key_file, knobs().api_key), users=read_users(auth_file),
                       operators=frozenset(args.admin))


def limiter_from_args(args: argparse.Namespace, credentials: Credentials) -> UserLimiter:
    return UserLimiter(args.max_concurrent_per_user, exempt=credentials.operators)


DRAIN_S = 20  # on SIGTERM, how long replies in flight may go on (k8s waits 30 s before SIGKILL)


def serve(app, host: str, port: int, on_exit, log_level: str = "warning", drain=None,
          drain_s: float = DRAIN_S) -> None:
    """uvicorn; on SIGTERM first `drain(drain_s)` (stop admitting, end what is in flight within the
    grace time), then uvicorn's own drain of connections; exit 0 once drained. on_exit() runs
    however it ends."""
    import signal

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and drain is not None and not self.should_exit:
                drain(drain_s)
            super().handle_exit(sig, frame)

    # uvicorn raises a SIGTERM it caught again once it has shut down, under the handler found at its
    # start: with this one the process then ends normally (0), its replies drained, not killed (-15).
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_s + 5)
    try:
        DrainingServer(config).run()
    finally:
        on_exit()


def run_server(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000,
               credentials: Credentials | None = None, limiter: UserLimiter | None = None,
               served_model_name: str | None = None, log_level: str = "info", log_format: str = "text",
               log_text: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES, private_metrics: bool = False,
               drain_s: float = DRAIN_S, **engine_options) -> None:
    """Load the model in the background and serve; /health says 503 until it is ready."""
    from engine.async_llm import AsyncLLM
    from server.routes import create_app

    setup_logging(log_format)
    llm = AsyncLLM(EngineConfig(model=model, **engine_options))
    app = create_app(llm, credentials=credentials, limiter=limiter, served_model_name=served_model_name,
                     log_text=log_text, max_request_bytes=max_request_bytes, private_metrics=private_metrics)
    serve(app, host, port, llm.shutdown, log_level, drain=llm.drain, drain_s=drain_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server", description="pagedchat OpenAI-compatible server")
    add_engine_args(parser)
    add_server_args(parser, port=8000)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        credentials = credentials_from_args(args)
        limiter = limiter_from_args(args, credentials)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    options = {k: v for k, v in config.__dict__.items() if k != "model"}
    run_server(config.model, host=args.host, port=args.port, credentials=credentials, limiter=limiter,
               served_model_name=args.served_model_name, log_format=args.log_format,
               log_text=args.log_message_text, max_request_bytes=args.max_request_bytes,
               private_metrics=args.private_metrics, drain_s=args.drain_seconds, **options)
