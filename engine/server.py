"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /tokenize,
/detokenize, /health, /metrics. Any OpenAI client works against it unchanged.

    python -m engine.server --model PATH --host 127.0.0.1 --port 8000
    from engine.server import run_server; run_server(model=..., port=8000)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import AsyncLLM, EngineDeadError
from engine.config import EngineConfig, add_engine_args, config_from_args
from engine.logs import add_logging_args, setup_logging
from engine.llm_engine import EngineOverloadedError
from engine.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                             TokenizeRequest, chat_chunk, completion_chunk, error_body, new_id, now, usage)

log = logging.getLogger("pagedchat.server")
request_log = logging.getLogger("pagedchat.requests")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


class RequestIdMiddleware:
    """Accept X-Request-Id (or make one), keep it on the request, echo it on the response."""

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


def log_request(request: Request, final, prompt_len: int, log_text: bool, messages=None) -> None:
    """One structured line per finished request; the message text only when asked for."""
    if final is None:
        return
    out, m = final.outputs[0], final.metrics
    record = {"event": "request_finished", "request_id": getattr(request.state, "request_id", None),
              "engine_request_id": final.request_id, "session": request.headers.get("x-session-id"),
              "prompt_tokens": prompt_len, "cached_tokens": final.num_cached_tokens,
              "completion_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
              "ttft_s": round(m.first_token_time - m.arrival_time, 4) if m and m.first_token_time else None,
              "e2e_s": round((m.finished_time or m.arrival_time) - m.arrival_time, 4) if m else None}
    if log_text:
        record["prompt"] = messages
        record["completion"] = out.text
    request_log.info(json.dumps(record))


def create_app(llm: AsyncLLM, *, api_key: str | None = None, served_model_name: str | None = None,
               log_text: bool = False) -> FastAPI:
    app = FastAPI(title="pagedchat", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIdMiddleware)
    app.state.llm = llm

    def model_name() -> str:
        return served_model_name or llm.model_name

    async def check_key(request: Request) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")

    def engine_or_503():
        if not llm.ready:
            raise APIError(503, llm.error or "the model is still loading", "service_unavailable")
        return llm.engine

    def check_model(name: str | None) -> None:
        if name and name != model_name():
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name()}`.",
                           "NotFoundError", "model", "model_not_found")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}"
                        for err in e.errors()[:5])
        return JSONResponse(error_body(msg or "invalid request", "invalid_request_error", where), status_code=400)

    @app.get("/health")
    async def health():
        if llm.ready:
            return {"status": "ok"}
        return JSONResponse({"status": llm.state, "error": llm.error}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        if llm.metrics is None:
            return Response("", media_type="text/plain; version=0.0.4")
        return Response(llm.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        engine = engine_or_503()
        return {"object": "list", "data": [{"id": model_name(), "object": "model", "created": now(),
                                            "owned_by": "pagedchat", "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest):
        engine = engine_or_503()
        check_model(body.model)
        if body.messages is not None:
            ids = render_chat(engine, body)
        elif body.prompt is not None:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise bad_request("give `prompt` or `messages`", "prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest):
        engine = engine_or_503()
        check_model(body.model)
        vocab = engine.hf_config.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = engine_or_503()
        check_model(body.model)
        ids = render_chat(engine, body)
        params = sampling(engine, body, ids)
        rid, created, name = new_id("chatcmpl"), now(), model_name()
        stream = llm.generate(ids, params, request_id=rid, priority=body.priority)
        on_finish = lambda final: log_request(request, final, len(ids), log_text, body.messages)  # noqa: E731
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(chat_events(await started(stream), rid, name, created, len(ids), include_usage,
                                   body.return_token_ids, on_finish))
        final = await collect(stream, request)
        on_finish(final)
        out = final.outputs[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": finish_reason(out)}
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": [choice],
                "usage": usage(len(ids), len(out.token_ids), final.num_cached_tokens)}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        engine = engine_or_503()
        check_model(body.model)
        prompts = [p if isinstance(p, list) else engine.tokenizer.encode(p) for p in body.prompts()]
        if not prompts:
            raise bad_request("prompt is empty", "prompt")
        params = [sampling(engine, body, ids) for ids in prompts]
        rid, created, name = new_id("cmpl"), now(), model_name()
        if body.stream:
            if len(prompts) != 1:
                raise bad_request("streaming takes a single prompt", "prompt")
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = llm.generate(prompts[0], params[0], request_id=rid, priority=body.priority)
            on_finish = lambda final: log_request(request, final, len(prompts[0]), log_text, body.prompt)  # noqa: E731
            return sse(completion_events(await started(stream), rid, name, created, len(prompts[0]), include_usage,
                                         body.return_token_ids, on_finish))
        finals = await asyncio.gather(*(collect(llm.generate(ids, p, request_id=f"{rid}-{i}", priority=body.priority),
                                                request) for i, (ids, p) in enumerate(zip(prompts, params))))
        choices, completion_tokens, cached = [], 0, 0
        for i, final in enumerate(finals):
            log_request(request, final, len(prompts[i]), log_text, body.prompt)
            out = final.outputs[0]
            text = (engine.tokenizer.decode(prompts[i]) if body.echo else "") + out.text
            choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(out)})
            if body.return_token_ids:
                choices[-1]["token_ids"] = out.token_ids
            completion_tokens += len(out.token_ids)
            cached += final.num_cached_tokens
        return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": usage(sum(map(len, prompts)), completion_tokens, cached)}

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, e: EngineOverloadedError):
        return JSONResponse(error_body(str(e), "service_unavailable", code="overloaded"), status_code=503)

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError):
        return JSONResponse(error_body(str(e), "service_unavailable"), status_code=503)

    @app.exception_handler(ValueError)
    async def invalid(_: Request, e: ValueError):
        return JSONResponse(error_body(str(e), "invalid_request_error", _param_of(str(e))), status_code=400)

    return app


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


def render_chat(engine, body) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own complaint is the clearest message
        raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None
    return engine.tokenizer.encode(text, add_special_tokens=False)


def sampling(engine, body: SamplingFields, ids: list[int]):
    limit = engine.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt is "
                          f"{len(ids)} tokens, which leaves no room for a completion.", "messages")
    wanted = body.requested_max_tokens()
    if wanted is not None and len(ids) + wanted > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for the completion).",
                          "max_tokens")
    try:
        return body.sampling_params(room=limit - len(ids))
    except ValueError as e:
        raise bad_request(str(e), _param_of(str(e))) from None


def finish_reason(out) -> str | None:
    if out.finish_reason == "error":
        raise APIError(500, "the request failed inside the engine", "internal_error")
    return out.finish_reason


async def collect(stream: AsyncIterator, request: Request):
    """Run a request to the end; if the client goes away first, cancel it (which aborts it)."""
    async def consume():
        last = None
        async for last in stream:
            pass
        return last

    task = asyncio.ensure_future(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            await stream.aclose()
            raise APIError(499, "client disconnected", "client_closed_request")
    return task.result()


async def started(stream: AsyncIterator) -> AsyncIterator:
    """Wait for the first output before the response starts, so a refused request (bad input,
    overload) still gets its proper status code instead of a 200 with an error inside."""
    first = await stream.__anext__()

    async def chained():
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
    return chained()


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except (EngineDeadError, EngineOverloadedError, ValueError) as e:
            yield f"data: {json.dumps(error_body(str(e), 'service_unavailable'))}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def events(stream, make_chunk, obj: str, rid: str, model: str, created: int, prompt_len: int,
           include_usage: bool, with_ids: bool, on_finish):
    """SSE payloads of one request: deltas, the finishing chunk, then usage if asked for.
    make_chunk(text, token_ids or None, finish_reason) builds the endpoint's chunk shape."""
    async def gen():
        async for out in stream:
            if out.delta_text or (with_ids and out.delta_token_ids):
                yield make_chunk(out.delta_text, out.delta_token_ids if with_ids else None, None)
            if not out.finished:
                continue
            on_finish(out)
            final = out.outputs[0]
            if final.finish_reason == "error":
                yield error_body(out.error or "the request failed inside the engine", "internal_error")
                return
            yield make_chunk("", None, final.finish_reason)
            if include_usage:
                yield {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                       "usage": usage(prompt_len, len(final.token_ids), out.num_cached_tokens)}
    return gen()


async def chat_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish):
    def make_chunk(text, token_ids, reason):
        chunk = chat_chunk(rid, model, created, {} if reason else {"content": text}, reason)
        if token_ids is not None:
            chunk["choices"][0]["token_ids"] = token_ids
        return chunk

    yield chat_chunk(rid, model, created, {"role": "assistant", "content": ""})
    async for event in events(stream, make_chunk, "chat.completion.chunk", rid, model, created, prompt_len,
                              include_usage, with_ids, on_finish):
        yield event


def completion_events(stream, rid, model, created, prompt_len, include_usage, with_ids, on_finish):
    def make_chunk(text, token_ids, reason):
        return completion_chunk(rid, model, created, text, finish_reason=reason, token_ids=token_ids)

    return events(stream, make_chunk, "text_completion", rid, model, created, prompt_len, include_usage,
                  with_ids, on_finish)


def run_server(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, log_level: str = "info", log_format: str = "text",
               log_text: bool = False, **engine_options) -> None:
    """Load the model in the background and serve; /health says 503 until it is ready."""
    import uvicorn

    setup_logging(log_format)
    llm = AsyncLLM(EngineConfig(model=model, **engine_options))
    app = create_app(llm, api_key=api_key, served_model_name=served_model_name, log_text=log_text)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pagedchat OpenAI-compatible server")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None)
    add_logging_args(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    options = {k: v for k, v in config.__dict__.items() if k != "model"}
    run_server(config.model, host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, log_format=args.log_format,
               log_text=args.log_message_text, **options)


if __name__ == "__main__":
    main()
