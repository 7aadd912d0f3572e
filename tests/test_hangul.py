"""Hangul end to end: a syllable is three UTF-8 bytes, and SmolLM2's byte-level tokenizer splits
many of them across tokens; none may be split or lost while streaming, stored, searched or exported."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.client import EngineDeadError, EngineOverloadedError
from engine.detokenizer import IncrementalDetokenizer
from server.limits import TooManyRequestsError
from storage import Store
from tests.fakes import FakeEngineClient
from ui.handlers import ChatHandlers
from ui.transfer import chat_markdown

TEXT = "안녕하세요, 주문하신 텐트는 내일 도착합니다. 환불은 영업일 기준 5~7일 걸립니다."


def test_streaming_hangul_token_by_token_never_splits_a_syllable(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [smol_tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # the test means something: some tokens are half a syllable
    detok = IncrementalDetokenizer(smol_tokenizer, smol_tokenizer.encode("Reply:"), True, [], False)
    deltas = []
    for t in ids:
        detok.add(t)
        deltas.append(detok.take_delta(False))
    deltas.append(detok.take_delta(True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_the_backends_decode_serves_only_where_it_equals_the_tokenizers(smol_tokenizer):
    """plain_decode skips transformers' wrapper for SmolLM2's fast tokenizer (no space clean-up), and
    decodes every slice of mixed text the same, special tokens kept or skipped; a tokenizer that cleans
    up spaces keeps its own decode."""
    import copy
    import random

    from engine.detokenizer import plain_decode
    decode = plain_decode(smol_tokenizer)
    assert decode != smol_tokenizer.decode
    ids = smol_tokenizer.encode(TEXT + " Order NW20481377 <|im_end|> ships, émoji 🎉 .", add_special_tokens=False)
    rng = random.Random(0)
    for a, b in ((a, rng.randrange(a, len(ids) + 1)) for a in (rng.randrange(len(ids)) for _ in range(300))):
        for skip in (True, False):
            assert decode(ids[a:b], skip_special_tokens=skip) == smol_tokenizer.decode(ids[a:b], skip_special_tokens=skip)
    cleaning = copy.copy(smol_tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert plain_decode(cleaning) == cleaning.decode


def test_a_korean_chat_is_stored_searched_and_exported_intact(smol_tokenizer, tmp_path):
    req = SimpleNamespace(username="minji", session_hash="t", headers={"accept-language": "ko-KR,ko;q=0.9"},
                          request=SimpleNamespace(path_params={"assistant": "support"}), cookies={})
    fake = FakeEngineClient(smol_tokenizer, reply=TEXT)
    chat = ChatHandlers(fake, Store(str(tmp_path / "c.db")), demo=False)
    uid, sid = chat.current(None, None, req)

    async def drain():
        return [u async for u in chat.send(uid, sid, "텐트 배송 언제 와요?", request=req)]
    asyncio.run(drain())
    messages = chat.store.messages(uid, sid)
    assert messages[0]["content"] == "텐트 배송 언제 와요?" and messages[1]["content"] == TEXT
    assert chat.store.session(uid, sid)["title"] == "텐트 배송 언제 와요?"
    assert [s["id"] for s in chat.store.sessions(uid, "환불")] == [sid]  # found by a word of the reply
    exported = json.loads(open(chat.export_json(uid, sid, req), encoding="utf-8").read())
    assert exported["messages"][1]["content"] == TEXT
    assert TEXT in chat_markdown(chat.store.session(uid, sid), messages)
    assert "대기 순서 1번" in chat.ask_person(uid, sid, req)[0]["value"]  # the status line in Korean


def korean(name: str = "minji"):
    return SimpleNamespace(username=name, session_hash="t", headers={"accept-language": "ko-KR,ko;q=0.9"},
                           request=SimpleNamespace(path_params={"assistant": "support"}), cookies={})


@pytest.mark.parametrize("refusal, said", [
    (EngineOverloadedError("engine overloaded: 300 requests waiting"), "매우 바빠"),
    (EngineDeadError("CUDA error: device-side assert"), "사용할 수 없어"),
    (TooManyRequestsError("you already have 2 requests in progress"), "다른 대화에서"),
    ("too long", "토큰이 되어"),
])
def test_a_refused_turn_is_explained_in_korean_on_the_korean_page(smol_tokenizer, tmp_path, refusal, said):
    """The engine's refusals reach a Korean customer in Korean, never the engine's English words;
    the message stays in the box, unsent."""
    fake = FakeEngineClient(smol_tokenizer)
    chat = ChatHandlers(fake, Store(str(tmp_path / "c.db")), demo=False)
    uid, sid = chat.current(None, None, korean())
    text = "텐트 " * 300 if refusal == "too long" else "텐트 배송 언제 와요?"
    if refusal != "too long":
        fake.refuse_with = refusal

    async def drain():
        return [u async for u in chat.send(uid, sid, text, request=korean())]
    with pytest.warns(UserWarning) as shown:
        updates = asyncio.run(drain())
    (warning,) = [str(w.message) for w in shown]
    assert said in warning and not any(word in warning for word in ("engine", "CUDA", "requests", "tokens long"))
    assert updates[-1][1] == text and chat.store.messages(uid, sid) == []


@pytest.mark.slow
@pytest.mark.e2e
def test_hangul_streams_whole_through_the_sse_api(tiny_chat_model):
    """A choice constraint makes the tiny random model say exactly TEXT; the SSE deltas rebuild it
    with no replacement character."""
    import httpx

    from engine import EngineConfig
    from engine.async_llm import AsyncLLM
    from tests.serving import LiveServer

    llm = AsyncLLM(EngineConfig(model=tiny_chat_model, dtype="float32", num_kv_blocks=64))
    with LiveServer(llm) as server:
        body = {"model": llm.info.name, "messages": [{"role": "user", "content": "배송 문의"}], "stream": True,
                "max_tokens": 200, "structured_outputs": {"choice": [TEXT]}}
        deltas = []
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        deltas.append(choice["delta"].get("content") or "")
    assert len([d for d in deltas if d]) > 3 and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_the_panel_shows_what_korean_costs_in_tokens(smol_tokenizer):
    from ui.panel import model_line

    line = model_line(FakeEngineClient(smol_tokenizer))
    ratios = {lang: float(value) for lang, value in
              (part.split() for part in line.split("tokens per character: ")[1].split("<")[0].split(" · "))}
    assert ratios["Korean"] > 4 * ratios["English"]  # SmolLM2's byte-level BPE: ~2 tokens a syllable


def test_every_customer_string_has_both_languages():
    from ui.i18n import SAID, TEXT

    for table in (TEXT, SAID):
        assert set(table["en"]) == set(table["ko"])
        assert all(table["ko"][k] and table["ko"][k] != table["en"][k] for k in table["en"] if k != "language")
