"""What every API route shares: the app's settings, and the FastAPI dependencies that find the
engine a request names, check its key and hold its place under the per-user cap."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from engine.client import EngineClient, ModelInfo
from server.auth import Credentials
from server.errors import APIError
from server.limits import UserLimiter


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
    """Once the server has keys or logins, every call needs a key; its name is the caller's."""
    credentials = request.app.state.settings.credentials
    request.state.key_name = credentials.key_name(request.headers.get("authorization"))
    if credentials.required and request.state.key_name is None:
        raise APIError(401, "missing or invalid API key (send `Authorization: Bearer KEY`)", "authentication_error",
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
