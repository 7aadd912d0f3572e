"""Customers the shop has signed in (`--customer-token-secret-file`): the shop's site puts a JWT it
signed (HS256, with the secret in that file) in the chat's address, `/chat/support/?customer_token=...`,
as Intercom's and Zendesk's identity verification do. The token names the customer (`sub`) and may
carry their `email` and `name`; it must expire (`exp`). pagedchat checks it once, keeps who it names
in a cookie it signs itself, and sends the browser on to the same address without the token (so it
leaves the address bar and the history). The chat then knows them: their chats follow them from
device to device, lookup_order trusts their e-mail address as if they had typed it, and agents see
their name. A token that fails any check is a 401 page saying why, in the customer's language."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode

import jwt

CUSTOMER_COOKIE = "pagedchat_customer"
TOKEN_PARAM = "customer_token"
MAX_COOKIE_S = 30 * 86400  # a cookie lasts as long as its token, at most this
MAX_FIELD_CHARS = 200
log = logging.getLogger("pagedchat.customers")


# why a token is refused, as the customer is told (the detail goes to the log)
REASONS = {
    "expired": ("the sign-in has expired", "로그인 유효 시간이 지났습니다"),
    "signature": ("it was not signed by the shop", "쇼핑몰이 서명한 링크가 아닙니다"),
    "claims": ("it does not say who you are", "고객 정보가 올바르지 않습니다"),
    "invalid": ("it is damaged", "링크가 손상되었습니다"),
}


class TokenRefused(ValueError):
    def __init__(self, key: str, detail: str = "") -> None:
        super().__init__(REASONS[key][0] + (f" ({detail})" if detail else ""))
        self.key, self.detail = key, detail


@dataclass(frozen=True)
class Customer:
    id: str
    email: str = ""
    name: str = ""


class CustomerTokens:
    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError("the customer token secret must be at least 32 characters (HS256 wants a long key)")
        self._secret = secret
        self._cookie_key = hashlib.sha256(f"pagedchat-customer:{secret}".encode()).digest()

    def verify(self, token: str) -> tuple[Customer, float]:
        """The customer a shop's token names, and when it expires; TokenRefused saying why not."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=["HS256"], leeway=30,
                                options={"require": ["sub", "exp"]})
        except jwt.ExpiredSignatureError:
            raise TokenRefused("expired") from None
        except jwt.InvalidSignatureError:
            raise TokenRefused("signature") from None
        except jwt.MissingRequiredClaimError as e:
            raise TokenRefused("claims", f"no '{e.claim}' claim") from None
        except jwt.InvalidTokenError as e:
            raise TokenRefused("invalid", str(e)) from None
        fields = {k: claims.get(k) for k in ("sub", "email", "name")}
        if not all(v is None or (isinstance(v, str) and len(v) <= MAX_FIELD_CHARS) for v in fields.values()) \
                or not fields["sub"]:
            raise TokenRefused("claims", f"sub, email and name must be strings of at most {MAX_FIELD_CHARS} characters")
        return Customer(fields["sub"], (fields["email"] or "").strip().lower(), fields["name"] or ""), claims["exp"]

    def cookie_value(self, customer: Customer, expires: float) -> str:
        body = json.dumps([customer.id, customer.email, customer.name, int(expires)], ensure_ascii=True).encode()
        return f"{body.hex()}.{hmac.new(self._cookie_key, body, hashlib.sha256).hexdigest()}"

    def from_cookie(self, value: str | None) -> Customer | None:
        """The customer our own cookie names, unless forged or past its token's expiry."""
        body_hex, _, signature = (value or "").partition(".")
        try:
            body = bytes.fromhex(body_hex)
        except ValueError:
            return None
        if not body or not hmac.compare_digest(signature, hmac.new(self._cookie_key, body, hashlib.sha256).hexdigest()):
            return None
        sub, email, name, expires = json.loads(body)
        return Customer(sub, email, name) if expires > time.time() else None


REFUSED = {
    "en": ("This chat link cannot sign you in: {why}. Open the chat again from the shop's site.", "Chat sign-in"),
    "ko": ("이 상담 링크로는 로그인할 수 없습니다: {why}. 쇼핑몰 사이트에서 상담을 다시 열어 주세요.", "상담 로그인"),
}


class CustomerTokenMiddleware:
    """A chat page's address carrying `customer_token`: checked, turned into our cookie, and sent on
    to the same address without it (303); a bad token is a 401 page saying why."""

    def __init__(self, app, tokens: CustomerTokens, embedded: bool = False) -> None:
        self.app, self.tokens, self.embedded = app, tokens, embedded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/chat/") \
                or TOKEN_PARAM.encode() not in scope.get("query_string", b""):
            return await self.app(scope, receive, send)
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        token = next((v for k, v in query if k == TOKEN_PARAM), None)
        if token is None:
            return await self.app(scope, receive, send)
        rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
        try:
            customer, expires = self.tokens.verify(token)
        except TokenRefused as e:
            log.info("customer token refused: %s", e)
            return await _page(send, 401, _refusal(scope, e.key))
        max_age = int(max(0, min(expires - time.time(), MAX_COOKIE_S)))
        cookie = (f"{CUSTOMER_COOKIE}={self.tokens.cookie_value(customer, expires)}; Path=/; HttpOnly; "
                  f"SameSite={'None; Secure' if self.embedded else 'Lax'}; Max-Age={max_age}")
        location = scope.get("root_path", "") + scope["path"] + (f"?{rest}" if rest else "")
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode()),
                                (b"cache-control", b"no-store"), (b"referrer-policy", b"no-referrer")]})
        await send({"type": "http.response.body", "body": b""})


def customer_in(cookies: dict, tokens: CustomerTokens | None) -> Customer | None:
    """The signed-in customer a request's cookies name (gr.Request.cookies), if any."""
    return tokens.from_cookie(cookies.get(CUSTOMER_COOKIE)) if tokens is not None else None


def _refusal(scope, key: str) -> str:
    import html

    # the language switch's cookie is already the Accept-Language here (server.middleware.LanguageCookieMiddleware)
    korean = dict(scope["headers"]).get(b"accept-language", b"").lower().startswith(b"ko")
    text, title = REFUSED["ko" if korean else "en"]
    why = REASONS[key][1 if korean else 0]
    return (f"<!doctype html><meta charset=utf-8><meta name=viewport content='width=device-width'><title>{title}"
            f"</title><body style='font-family:sans-serif;max-width:36em;margin:2em auto;padding:0 1em'><h1 "
            f"style='font-size:1.2em'>{title}</h1><p>{html.escape(text.format(why=why))}</p></body>")


async def _page(send, status: int, body: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body.encode()})
