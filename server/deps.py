"""What every API route shares: the app's settings, the FastAPI dependencies that find the
engine a request names, check its key and hold its place under the per-user cap, and a chat
request's prompt and sampling parameters (the chat, Responses and Messages routes all make them)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from engine.client import EngineClient, ModelInfo
from engine.errors import ParameterError, parameter_of
from engine.tools import render
from server.auth import Credentials
from server.errors import APIError, bad_request
from server.limits import UserLimiter
from server.logs import log_request
from server.protocol import ChatCompletionRequest, SamplingFields


@dataclass
class Settings:
    credentials: Credentials
    limiter: UserLimiter
    served_model_name: str | None = None
    log_text: bool = False  # log prompts and completions (off: never logged)
    private_metrics: bool = False  # /metrics needs a key (once there are any), like /v1
    health_checks: dict = field(default_factory=dict)  # part -> () -> None if it serves, else why not


# ---- dependencies -------------------------------------------------------------------------
def engine_client(request: Request) -> EngineClient:
    return request.app.state.client


def model_info(request: Request) -> ModelInfo:
    """The loaded model's facts, or 503 while loading / after a crash."""
    client = engine_client(request)
    if not client.ready or client.info is None:
        raise APIError(503, client.error or "the model is still loading", "service_unavailable")
    return client.info


def served_name(request: Request, info: ModelInfo) -> str:
    return request.app.state.settings.served_model_name or info.name


async def check_key(request: Request) -> None:
    """Once the server has keys or logins, every call needs a key (`Authorization: Bearer KEY`, or
    `x-api-key: KEY`); its name is the caller's."""
    credentials = request.app.state.settings.credentials
    anthropic = request.headers.get("x-api-key")  # how Anthropic's clients send it
    request.state.key_name = credentials.key_name(request.headers.get("authorization")
                                                  or (f"Bearer {anthropic}" if anthropic else None))
    if credentials.required and request.state.key_name is None:
        raise APIError(401, "missing or invalid API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
                       "authentication_error",
                       code="invalid_api_key")


def take_slot(request: Request):
    """A slot under the per-user cap (the key's name, else the client's address); returns its release."""
    name = request.state.key_name
    user = f"key:{name}" if name else f"ip:{request.client.host if request.client else '?'}"
    limiter = request.app.state.settings.limiter
    limiter.acquire(user, name)
    return lambda: limiter.release(user)


async def holding(stream, release):
    """`stream`, releasing the caller's slot when it ends however it ends."""
    try:
        async for out in stream:
            yield out
    finally:
        release()


def serving(request: Request, name: str | None) -> tuple[EngineClient, ModelInfo, str]:
    """(engine, its model's facts, the name answers carry) for a request's `model`: the main model
    when it names it or nothing, else another model loaded for an assistant (engine.fleet), by its
    name. 404 for a name the server does not serve, 503 while the model loads."""
    others = request.app.state.others()
    if name and name in others:
        client = others[name]
        if not client.ready or client.info is None:
            raise APIError(503, client.error or f"the model {name} is still loading", "service_unavailable")
        return client, client.info, name
    info = model_info(request)
    served = served_name(request, info)
    if name and name != served:
        known = ", ".join(f"`{n}`" for n in [served, *others])
        raise APIError(404, f"The model `{name}` does not exist; this server serves {known}.",
                       "NotFoundError", "model", "model_not_found")
    return engine_client(request), info, served


# ---- a request's prompt and sampling ------------------------------------------------------
def render_chat(info: ModelInfo, body) -> list[int]:
    chat = isinstance(body, ChatCompletionRequest)
    plan, options = (body.tool_plan, body.template_options()) if chat else (None, {})
    try:
        return render(info.tokenizer, [m.as_dict() for m in body.messages], plan, **options)
    except ParameterError:
        raise
    except Exception as e:  # noqa: BLE001 - the template's own complaint is the clearest message
        raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None


def sampling(info: ModelInfo, body: SamplingFields, ids: list[int]):
    """SamplingParams for one prompt; max_tokens defaults to the room left in the context. A prompt
    that leaves no room at all is refused by the engine (ContextLengthError)."""
    refused = body.not_implemented()
    if refused:
        raise bad_request(f"`{refused}` is not supported by this server yet; leave it out of the request.", refused)
    limit, wanted = info.max_model_len, body.requested_max_tokens()
    if wanted is not None and len(ids) < limit < len(ids) + wanted:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for the completion).",
                          "max_tokens")
    try:
        return body.sampling_params(room=max(limit - len(ids), 1), defaults=info.sampling_defaults)
    except ValueError as e:
        raise bad_request(str(e), parameter_of(e)) from None


def finish_logger(request: Request, prompt_len: int, prompt):
    def on_finish(final) -> None:
        log_request(getattr(request.state, "request_id", None), request.headers.get("x-session-id"), final,
                    prompt_len, request.app.state.settings.log_text, prompt)
    return on_finish


async def prepare_chat(request: Request, chat: ChatCompletionRequest):
    """(engine, its model's facts, the served name, prompt ids, SamplingParams) of a chat request."""
    client, info, name = serving(request, chat.model)
    ids = await asyncio.to_thread(render_chat, info, chat)
    return client, info, name, ids, sampling(info, chat, ids)


def generation(request: Request, client: EngineClient, ids: list[int], params, request_id: str,
               chat: ChatCompletionRequest):
    """The engine's stream for a chat request, holding the caller's slot under the per-user cap until it ends."""
    release = take_slot(request)
    return holding(client.generate(ids, params, request_id=request_id, priority=chat.priority,
                                   session_id=request.headers.get("x-session-id"), cache_salt=chat.cache_salt),
                   release)
