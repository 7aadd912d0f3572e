"""Customers the shop signs in (`--customer-token-secret-file`): its JWT is checked (signature,
expiry, claims; `alg: none` and other keys refused), turned into our own signed cookie, and the
browser sent on without the token; the chat then knows the customer, lookup_order trusts their
address, and agents see their name. A bad token is a 401 page saying why."""
import time

import httpx
import jwt
import pytest
from gradio_client import Client

from app import build_app, parse_args
from server.customers import CUSTOMER_COOKIE, Customer, CustomerTokens, TokenRefused
from storage import Store
from tests.serving import LiveServer, logins_file

SECRET = "s3cret-of-the-shop-" + "x" * 20


def token(secret: str = SECRET, algorithm: str = "HS256", **claims) -> str:
    claims = {"sub": "c-42", "email": "Dana@Example.com", "name": "Dana", "exp": time.time() + 600, **claims}
    return jwt.encode({k: v for k, v in claims.items() if v is not None}, secret, algorithm=algorithm)


def test_a_shops_token_names_the_customer():
    customer, expires = CustomerTokens(SECRET).verify(token())
    assert customer == Customer("c-42", "dana@example.com", "Dana") and expires > time.time()


@pytest.mark.parametrize("bad, key", [
    (token(exp=time.time() - 3600), "expired"),
    (token(secret="another-shop-" + "y" * 30), "signature"),
    (token(exp=None), "claims"),
    (token(sub=None), "claims"),
    (token(name=["not", "a", "string"]), "claims"),
    ("not.a.token", "invalid"),
])
def test_a_bad_token_is_refused_saying_why(bad, key):
    with pytest.raises(TokenRefused) as refused:
        CustomerTokens(SECRET).verify(bad)
    assert refused.value.key == key


def test_an_unsigned_token_is_refused():
    unsigned = jwt.encode({"sub": "c-1", "exp": time.time() + 60}, None, algorithm="none")
    with pytest.raises(TokenRefused):
        CustomerTokens(SECRET).verify(unsigned)


def test_our_cookie_cannot_be_forged_and_ends_with_the_token():
    tokens = CustomerTokens(SECRET)
    value = tokens.cookie_value(Customer("c-42", "dana@example.com", "Dana"), time.time() + 60)
    assert tokens.from_cookie(value) == Customer("c-42", "dana@example.com", "Dana")
    body, signature = value.split(".")
    forged = Customer("c-43", "dana@example.com", "Dana")
    assert tokens.from_cookie(tokens.cookie_value(forged, time.time() + 60).split(".")[0] + "." + signature) is None
    assert tokens.from_cookie(value + "0") is None and tokens.from_cookie("zz.zz") is None
    assert CustomerTokens("z" * 40).from_cookie(value) is None  # another deployment's key
    assert tokens.from_cookie(tokens.cookie_value(Customer("c-42"), time.time() - 1)) is None
    with pytest.raises(ValueError, match="at least 32"):
        CustomerTokens("short")


@pytest.fixture(scope="module")
def shop(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("customers")
    secret_file = folder / "customer-secret"
    secret_file.write_text(SECRET + "\n")
    db = str(folder / "chat.db")
    args = parse_args(["--db", db, "--model", tiny_chat_model, "--dtype", "float32", "--num-kv-blocks", "256",
                       "--auth-file", logins_file(folder, bo="pw-bo-123"), "--agent", "bo",
                       "--customer-token-secret-file", str(secret_file)])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.db = db
        yield server


@pytest.mark.e2e
def test_a_signed_in_customers_order_is_looked_up_without_typing_the_address(shop):
    r = httpx.get(f"{shop.url}/chat/support/?lang=ko&customer_token={token()}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/chat/support/?lang=ko"  # the token leaves the address
    cookie = r.cookies[CUSTOMER_COOKIE]
    assert "HttpOnly" in r.headers["set-cookie"] and "c-42" not in r.headers["location"]
    client = Client(f"{shop.url}/chat/support/", headers={"Cookie": f"{CUSTOMER_COOKIE}={cookie}"}, verbose=False)
    client.predict("Where is my order NW20481377?", api_name="/send")  # Dana placed it; she types no address
    store = Store(shop.db)
    (session,) = store.sessions("customer:c-42")
    reply = store.messages("customer:c-42", session["id"])[-1]
    assert "is shipped" in reply["tool_calls"][0]["result"]
    client.predict("talk to a person", api_name="/send")
    row = next(r for r in store_inbox(shop) if r["id"] == session["id"])
    assert (row["name"], row["email"]) == ("Dana", "dana@example.com")  # the inbox names her


def store_inbox(shop):
    from storage.handoff import Handoff

    return Handoff(Store(shop.db)).inbox()


@pytest.mark.e2e
def test_another_customer_with_the_number_but_not_the_address_learns_nothing(shop):
    r = httpx.get(f"{shop.url}/chat/support/?customer_token={token(sub='c-99', email='mal@example.com')}")
    client = Client(f"{shop.url}/chat/support/", verbose=False,
                    headers={"Cookie": f"{CUSTOMER_COOKIE}={r.cookies[CUSTOMER_COOKIE]}"})
    client.predict("Where is my order NW20481377?", api_name="/send")
    store = Store(shop.db)
    (session,) = store.sessions("customer:c-99")
    result = store.messages("customer:c-99", session["id"])[-1]["tool_calls"][0]["result"]
    assert "No order NW20481377 was placed with" in result and "UPS" not in result


@pytest.mark.e2e
@pytest.mark.parametrize("language, said", [("en", "the sign-in has expired"), ("ko", "로그인 유효 시간이 지났습니다")])
def test_an_expired_link_is_a_page_saying_so(shop, language, said):
    r = httpx.get(f"{shop.url}/chat/support/?customer_token={token(exp=time.time() - 3600)}",
                  headers={"Accept-Language": language})
    assert r.status_code == 401 and said in r.text and CUSTOMER_COOKIE not in r.cookies
    huge = httpx.get(f"{shop.url}/chat/support/?customer_token={'x' * 20000}", headers={"Accept-Language": language})
    assert huge.status_code == 401 and CUSTOMER_COOKIE not in huge.cookies
    elsewhere = httpx.get(f"{shop.url}/health?customer_token={token()}")  # only the chat's pages take one
    assert elsewhere.status_code == 200 and CUSTOMER_COOKIE not in elsewhere.cookies
