"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /tokenize,
/detokenize, /health (and vLLM's /ping), /version, /metrics (and /v1/responses in
server/responses_api.py, Anthropic's /v1/messages in server/anthropic_api.py). Handlers are thin: they
validate, render the prompt, and hand the request to whatever EngineClient the app was built with
(in-process or remote)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine import __version__
from engine.client import EngineClient
from engine.metrics import merge_expositions
from engine.tool_calls import parse_reply
from server.anthropic_api import router as anthropic_router
from server.auth import Credentials
from server.deps import (Settings, check_key, engine_client, finish_logger, generation, holding, model_info,
                         prepare_chat, render_chat, sampling, served_name, serving, take_slot)
from server.errors import APIError, bad_request, install_error_handlers
from server.limits import UserLimiter
from server.http_metrics import HTTPMetrics, HTTPMetricsMiddleware
from server.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.replies import new_id, now, usage
from server.logprobs import CompletionLogprobs, chat_logprobs
from server.responses_api import ResponseStore
from server.responses_api import router as responses_router
from server.streaming import chat_events, collect, completion_events, finish_reason, sse, started

PROMETHEUS = "text/plain; version=0.0.4"
MAX_REQUEST_BYTES = 4 << 20


def create_app(client: EngineClient, *, credentials: Credentials | None = None, limiter: UserLimiter | None = None,
               served_model_name: str | None = None, log_text: bool = False,
               max_request_bytes: int = MAX_REQUEST_BYTES, private_metrics: bool = False) -> FastAPI:
    """credentials: API keys (and logins); once there are any, every API call needs a key (and
    /metrics too with `private_metrics`).
    limiter: the per-user cap, shared with the chat page when both run in one process."""
    app = FastAPI(title="pagedchat", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_bytes)
    app.add_middleware(RequestIdMiddleware)
    app.state.http_metrics = HTTPMetrics()
    app.add_middleware(HTTPMetricsMiddleware, metrics=app.state.http_metrics)  # outermost: refusals count too
    app.state.client = client
    app.state.others = dict  # () -> served name -> another model's engine (app.py: engine.fleet's, by name)
    app.state.settings = Settings(credentials or Credentials(), limiter or UserLimiter(0), served_model_name, log_text,
                                  private_metrics)
    app.state.responses = ResponseStore()
    app.include_router(responses_router)  # before `router`, whose last route refuses every other /v1 path
    app.include_router(anthropic_router)
    app.include_router(router)
    install_error_handlers(app)
    return app


# ---- routes -------------------------------------------------------------------------------
router = APIRouter()
guarded = [Depends(check_key)]


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    """200 "ok" when the engine serves; 200 "degraded" when it does but another part (the chat's
    database) does not, with why; 503 while the engine loads or after it died. HEAD for uptime
    monitors that ask with it (the status code alone)."""
    client = engine_client(request)
    problems = {part: why for part, check in request.app.state.settings.health_checks.items() if (why := check())}
    if not client.ready:
        return JSONResponse({"status": client.state, "error": client.error, **problems}, status_code=503)
    return {"status": "degraded", **problems} if problems else {"status": "ok"}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    """vLLM's (and SageMaker's) liveness route: /health's answer."""
    return await health(request)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request):
    if request.app.state.settings.private_metrics:
        await check_key(request)
    texts = [engine_client(request).metrics_text(), *(c.metrics_text() for c in request.app.state.others().values()),
             request.app.state.http_metrics.exposition()]
    return Response(merge_expositions(texts), media_type=PROMETHEUS)


@router.get("/v1/models", dependencies=guarded)
async def models(request: Request):
    return {"object": "list", "data": [model_card(name, i) for name, i in loaded_models(request).items()]}


@router.get("/v1/models/{name:path}", dependencies=guarded)
async def retrieve_model(name: str, request: Request):
    loaded = loaded_models(request)
    if name not in loaded:
        serving(request, name or "(none)")  # 503 while it loads, else 404 naming the models served
    return model_card(name, loaded[name])


def loaded_models(request: Request) -> dict:
    info = model_info(request)
    return {served_name(request, info): info, **{name: c.info for name, c in request.app.state.others().items()
                                                 if c.ready and c.info is not None}}


def model_card(name: str, info) -> dict:
    return {"id": name, "object": "model", "created": now(), "owned_by": "pagedchat",
            "max_model_len": info.max_model_len}


@router.post("/tokenize", dependencies=guarded)
async def tokenize(body: TokenizeRequest, request: Request):
    _, info, _ = serving(request, body.model)
    if body.messages is not None:
        ids = await asyncio.to_thread(render_chat, info, body.as_chat())
    elif body.prompt is not None:
        ids = await asyncio.to_thread(info.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise bad_request("give `prompt` or `messages`", "prompt")
    strs = {"token_strs": info.tokenizer.convert_ids_to_tokens(ids)} if body.return_token_strs else {}
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, **strs}


@router.post("/detokenize", dependencies=guarded)
async def detokenize(body: DetokenizeRequest, request: Request):
    _, info, _ = serving(request, body.model)
    if any(t < 0 or t >= info.vocab_size for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {info.vocab_size})", "tokens")
    return {"prompt": info.tokenizer.decode(body.tokens)}


@router.post("/v1/chat/completions", dependencies=guarded)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    client, info, name, ids, params = await prepare_chat(request, body)
    tools = body.tool_plan is not None and body.tool_plan.grammar is not None
    rid, created = new_id("chatcmpl"), now()
    on_finish = finish_logger(request, len(ids), body.messages)
    stream = generation(request, client, ids, params, rid, body)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(chat_events(await started(stream), rid, name, created, len(ids), include_usage,
                               body.return_token_ids, on_finish, params.logprobs, params.n, tools))
    final = await collect(stream, request)
    on_finish(final)
    choices = []
    for out in final.outputs:
        scores = chat_logprobs(out.token_ids, out.logprobs, params.logprobs) if params.logprobs is not None else None
        message, reason = {"role": "assistant", "content": out.text}, finish_reason(out, final.error)
        if tools:
            message["content"], calls = parse_reply(out.text)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": out.index, "message": message, "logprobs": scores, "finish_reason": reason})
        if body.return_token_ids:
            choices[-1]["token_ids"] = out.token_ids
    return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
            "usage": usage(len(ids), sum(len(out.token_ids) for out in final.outputs), final.num_cached_tokens)}


@router.post("/v1/completions", dependencies=guarded)
async def completions(body: CompletionRequest, request: Request):
    client, info, name = serving(request, body.model)
    prompts = [p if isinstance(p, list) else await asyncio.to_thread(info.tokenizer.encode, p)
               for p in body.prompts()]
    if not prompts:
        raise bad_request("prompt is empty", "prompt")
    if body.stream and len(prompts) != 1:
        raise bad_request("streaming takes a single prompt", "prompt")
    params = [sampling(info, body, ids) for ids in prompts]
    rid, created, session = new_id("cmpl"), now(), request.headers.get("x-session-id")

    def generate(i: int):
        return client.generate(prompts[i], params[i], request_id=rid if body.stream else f"{rid}-{i}",
                               priority=body.priority, session_id=session, cache_salt=body.cache_salt)

    def scorer():
        return CompletionLogprobs(body.logprobs, lambda t: info.tokenizer.decode([t])) if body.logprobs is not None \
            else None

    release = take_slot(request)  # one slot for the whole request, however many prompts it carries
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = (info.tokenizer.decode(prompts[0]), prompts[0]) if body.echo else None
        return sse(completion_events(await started(holding(generate(0), release)), rid, name, created,
                                     len(prompts[0]), include_usage, body.return_token_ids,
                                     finish_logger(request, len(prompts[0]), body.prompt),
                                     scorer if body.logprobs is not None else None, echo, body.n))
    try:
        finals = await asyncio.gather(*(collect(generate(i), request) for i in range(len(prompts))))
    finally:
        release()
    choices, completion_tokens, cached = [], 0, 0
    for i, final in enumerate(finals):
        finish_logger(request, len(prompts[i]), body.prompt)(final)
        for out in final.outputs:  # n samples of prompt i are choices i*n ... i*n + n-1, as OpenAI numbers them
            score, scores = scorer(), None
            text = (info.tokenizer.decode(prompts[i]) if body.echo else "") + out.text
            if score is not None:  # with echo the prompt's tokens come first, the first one unscored
                parts = [score(prompts[i], final.prompt_logprobs)] if body.echo else []
                parts.append(score(out.token_ids, out.logprobs))
                scores = {key: [v for part in parts for v in part[key]] for key in parts[0]}
            choices.append({"index": i * body.n + out.index, "text": text, "logprobs": scores,
                            "finish_reason": finish_reason(out, final.error)})
            if body.return_token_ids:
                choices[-1]["token_ids"] = out.token_ids
            completion_tokens += len(out.token_ids)
        cached += final.num_cached_tokens
    return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
            "usage": usage(sum(map(len, prompts)), completion_tokens, cached)}


@router.post("/reset_prefix_cache", dependencies=guarded)
async def reset_prefix_cache(request: Request):
    """Operators only (a key whose name is given to --admin): forget every cached prefix."""
    if request.state.key_name not in request.app.state.settings.credentials.operators:
        raise APIError(403, "resetting the prefix cache needs an operator's key (a key named in --admin)",
                       "permission_error", code="not_operator")
    model_info(request)
    await asyncio.to_thread(engine_client(request).reset_prefix_cache)
    return {"reset": True}


@router.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                  include_in_schema=False)
async def unknown_api_route(request: Request):
    """Everything else under /v1 is the API's to refuse (in OpenAI's shape), even with the chat page
    mounted at / behind it: 405 for a route that exists under another method, else 404."""
    path = request.url.path
    routes = [*responses_router.routes, *anthropic_router.routes, *router.routes]
    if any(route.path_regex.match(path) for route in routes if route.endpoint is not unknown_api_route):
        raise APIError(405, f"{request.method} is not allowed on {path}.", "invalid_request_error")
    raise APIError(404, f"No route {path}.", "invalid_request_error")
