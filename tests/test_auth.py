"""Fast tier: who may call, and how much. Keys and logins from files (hashed passwords), the signed
visitor cookie, the per-user cap (429 + Retry-After, slots given back however a request ends), the
operator-only prefix-cache reset, and cache_salt reaching the engine."""
import os
import stat
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from server.auth import (VISITOR_COOKIE, Credentials, VisitorCookie, hash_password, read_api_keys, read_users,
                         verify_password)
from server.limits import TooManyRequestsError, UserLimiter
from server.middleware import VisitorCookieMiddleware
from server.routes import create_app
from tests.fakes import FakeEngineClient

HELLO = [{"role": "user", "content": "Where is my parcel?"}]
KEYS = {"sk-alice-0001": "alice", "sk-ops-000002": "ops"}


@pytest.fixture
def fake(smol_tokenizer):
    return FakeEngineClient(smol_tokenizer)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_passwords_are_stored_as_salted_scrypt_hashes():
    stored = hash_password("correct horse")
    assert stored.startswith("scrypt$") and "correct horse" not in stored
    assert stored != hash_password("correct horse")  # salted
    assert verify_password("correct horse", stored) and not verify_password("wrong horse", stored)
    assert not verify_password("correct horse", "plain:correct horse")


def test_add_user_writes_an_owner_only_file_of_hashes(tmp_path):
    path = tmp_path / "logins.txt"
    for name, password in (("alice", "alice-password"), ("bob", "bob-password"), ("alice", "alice-new-pass")):
        subprocess.run([sys.executable, "-m", "server.auth", "add-user", str(path), name], input=password + "\n",
                       text=True, check=True, capture_output=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "password" not in path.read_text() and "pass" not in path.read_text()
    users = read_users(str(path))
    assert set(users) == {"alice", "bob"}
    credentials = Credentials(users=users)
    assert credentials.check_login("alice", "alice-new-pass") and not credentials.check_login("alice", "alice-password")
    short = subprocess.run([sys.executable, "-m", "server.auth", "add-user", str(path), "carol"], input="short\n",
                           text=True, capture_output=True)
    assert short.returncode != 0 and "8 characters" in short.stderr


def test_plain_passwords_and_short_keys_are_refused_when_read(tmp_path):
    logins = tmp_path / "logins.txt"
    logins.write_text("alice:hunter22\n")
    with pytest.raises(ValueError, match="plain passwords are not accepted"):
        read_users(str(logins))
    keys = tmp_path / "keys.txt"
    keys.write_text("# shop keys\nalice:sk-alice-0001\nsk-unnamed-0003\n")
    assert read_api_keys(str(keys), env_key="sk-from-env-04") == {
        "sk-alice-0001": "alice", "sk-unnamed-0003": "api", "sk-from-env-04": "api"}
    keys.write_text("bob:short\n")
    with pytest.raises(ValueError, match="at least 8"):
        read_api_keys(str(keys))


def test_credentials_name_keys_logins_and_operators():
    credentials = Credentials(keys=KEYS, users={"carol": hash_password("carol-pass")}, operators=frozenset({"ops"}))
    assert credentials.key_name("Bearer sk-alice-0001") == "alice" and credentials.key_name("bearer sk-ops-000002") == "ops"
    assert credentials.key_name("Bearer sk-alice-000") is None and credentials.key_name("Basic x") is None
    assert credentials.check_login("alice", "sk-alice-0001")  # the page takes a key with its name
    assert not credentials.check_login("ops", "sk-alice-0001") and credentials.check_login("carol", "carol-pass")
    with pytest.raises(ValueError, match="not among them: mallory"):
        Credentials(keys=KEYS, operators=frozenset({"mallory"}))


def test_keys_and_cookie_signatures_are_compared_in_constant_time(monkeypatch):
    """Every comparison of a secret goes through hmac.compare_digest (its time does not depend on
    where the first wrong byte is), for API keys, logins by key, and visitor cookies."""
    import hmac

    import server.auth

    compared, original = [], hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(server.auth.hmac, "compare_digest", recording)
    credentials = Credentials(keys=KEYS)
    assert credentials.key_name("Bearer sk-alice-0002") is None
    assert {a for a, _ in compared} == {k.encode() for k in KEYS}  # each known key, compared whole
    compared.clear()
    assert not credentials.check_login("alice", "sk-alice-0002") and compared
    compared.clear()
    cookie = VisitorCookie("server-secret")
    assert cookie.visitor("someone." + "0" * 64) is None and len(compared) == 1


def test_the_visitor_cookie_is_issued_httponly_and_only_our_signature_counts():
    cookie = VisitorCookie("server-secret")
    value = cookie.issue()
    visitor = cookie.visitor(value)
    assert visitor and value.startswith(visitor + ".")
    assert cookie.visitor(f"{visitor}.{'0' * 64}") is None and cookie.visitor("someone-else") is None
    assert VisitorCookie("another-secret").visitor(value) is None
    app = FastAPI()

    @app.get("/seen")
    def seen(request: Request):
        return {"visitor": cookie.visitor(request.cookies.get(VISITOR_COOKIE))}

    http = TestClient(VisitorCookieMiddleware(app, cookie=cookie))
    first = http.get("/seen")
    set_cookie = first.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=Lax" in set_cookie
    assert first.json()["visitor"]  # the first request already carries its new id
    assert http.get("/seen").json() == first.json() and "set-cookie" not in http.get("/seen").headers
    forged = TestClient(VisitorCookieMiddleware(app, cookie=cookie), cookies={VISITOR_COOKIE: f"{visitor}.forged"})
    assert forged.get("/seen").json()["visitor"] not in (None, visitor)  # a forged id is replaced by a new one


def test_with_any_credential_every_api_call_needs_a_key(fake):
    http = TestClient(create_app(fake, credentials=Credentials(users={"carol": hash_password("carol-pass")})))
    r = http.post("/v1/chat/completions", json={"messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("private", [False, True])
def test_metrics_need_a_key_only_with_private_metrics(fake, private):
    http = TestClient(create_app(fake, credentials=Credentials(keys=KEYS), private_metrics=private))
    anonymous = http.get("/metrics")
    assert anonymous.status_code == (401 if private else 200)
    keyed = http.get("/metrics", headers={"Authorization": "Bearer sk-ops-000002"})
    assert keyed.status_code == 200 and keyed.text.startswith("# fake")


def test_the_per_user_cap_answers_429_with_retry_after_and_spares_others(fake):
    limiter = UserLimiter(2, exempt=frozenset({"ops"}))
    http = TestClient(create_app(fake, credentials=Credentials(keys=KEYS, operators=frozenset({"ops"})),
                                 limiter=limiter))
    limiter.acquire("key:alice")
    limiter.acquire("key:alice")  # two of alice's requests in flight
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"messages": HELLO, "stream": stream}, headers=bearer("sk-alice-0001"))
        assert r.status_code == 429 and r.headers["retry-after"].isdigit(), r.text
        assert r.json()["error"]["type"] == "rate_limit_error" and "limit per user is 2" in r.json()["error"]["message"]
    limiter.acquire("key:ops")
    limiter.acquire("key:ops")
    assert http.post("/v1/completions", json={"prompt": "Hi"}, headers=bearer("sk-ops-000002")).status_code == 200
    limiter.release("key:alice")
    assert http.post("/v1/completions", json={"prompt": "Hi"}, headers=bearer("sk-alice-0001")).status_code == 200
    assert limiter.in_flight("key:alice") == 1 and limiter.in_flight("key:ops") == 2


def test_every_way_a_request_ends_gives_its_slot_back(fake):
    limiter = UserLimiter(1)
    http = TestClient(create_app(fake, limiter=limiter))
    user = "ip:testclient"
    for body in ({"messages": HELLO}, {"messages": HELLO, "stream": True}, {"messages": HELLO, "max_tokens": 10 ** 6}):
        http.post("/v1/chat/completions", json=body)
        assert limiter.in_flight(user) == 0, body
    fake.refuse_with = ValueError("temperature is poisoned")
    assert http.post("/v1/chat/completions", json={"messages": HELLO, "stream": True}).status_code == 400
    assert http.post("/v1/completions", json={"prompt": ["a", "b"]}).status_code == 400
    assert limiter.in_flight(user) == 0
    fake.refuse_with = None
    with http.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "stream": True}) as r:
        next(r.iter_lines())  # the client leaves after the first chunk
    assert limiter.in_flight(user) == 0
    assert http.post("/v1/completions", json={"prompt": ["a", "b", "c"]}).status_code == 200  # one slot per request


def test_prefix_cache_reset_is_for_operator_keys_only(fake):
    http = TestClient(create_app(fake, credentials=Credentials(keys=KEYS, operators=frozenset({"ops"}))))
    assert http.post("/reset_prefix_cache").status_code == 401
    r = http.post("/reset_prefix_cache", headers=bearer("sk-alice-0001"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_operator" and fake.resets == 0
    r = http.post("/reset_prefix_cache", headers=bearer("sk-ops-000002"))
    assert r.status_code == 200 and r.json() == {"reset": True} and fake.resets == 1
    assert TestClient(create_app(fake)).post("/reset_prefix_cache").status_code == 403  # an open server has no operators


def test_cache_salt_reaches_the_engine_and_is_checked(fake):
    http = TestClient(create_app(fake))
    http.post("/v1/chat/completions", json={"messages": HELLO, "cache_salt": "tenant-7"})
    assert fake.requests[-1]["cache_salt"] == "tenant-7"
    http.post("/v1/completions", json={"prompt": "Hi"})
    assert fake.requests[-1]["cache_salt"] is None
    r = http.post("/v1/completions", json={"prompt": "Hi", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_the_limiter_counts_per_user_and_refuses_a_negative_limit():
    limiter = UserLimiter(1)
    with limiter.slot("a"):
        with pytest.raises(TooManyRequestsError):
            limiter.acquire("a")
        with limiter.slot("b"):
            assert limiter.in_flight("b") == 1
    assert limiter.in_flight("a") == 0
    with pytest.raises(ValueError):
        UserLimiter(-1)


def test_the_operators_downloads_take_an_operators_key_too(fake, tmp_path):
    from storage import Store
    from ui import downloads

    app = create_app(fake, credentials=Credentials(keys=KEYS, operators=frozenset({"ops"})))
    downloads.add_route(app, Store(str(tmp_path / "chat.db")), Credentials(keys=KEYS, operators=frozenset({"ops"})))
    http = TestClient(app)
    assert http.get("/console/export/feedback.jsonl").status_code == 401
    assert http.get("/console/export/feedback.jsonl", headers=bearer("sk-alice-0001")).status_code == 403
    r = http.get("/console/export/analytics.csv", headers=bearer("sk-ops-000002"))
    assert r.status_code == 200 and r.text.startswith("\ufeffday,assistant")
