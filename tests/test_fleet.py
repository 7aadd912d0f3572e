"""An assistant's own model: the fleet starts an engine per offered model an assistant names, its
chats go to that engine (turns, stop), and in-process engines take turns on the CPU, first come
first served."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from engine import cpu_turns
from engine.fleet import ModelFleet
from storage import Store
from tests.fakes import FakeEngineClient
from tests.serving import wait_for
from ui import assistants
from ui.console import AssistantEditor
from ui.handlers import ChatHandlers
from ui.operator import OperatorHandlers
from ui.panel import others_line

OFFERED = {"main (embedded)": None, "qwen-ko": "/models/qwen-ko"}


@pytest.fixture
def engines(smol_tokenizer):
    main = FakeEngineClient(smol_tokenizer, name="main-model", reply=" From the main model.")
    started = []

    def start(model):
        started.append(model)
        return FakeEngineClient(smol_tokenizer, name=f"served:{model}", reply=" 한국어 모델입니다.")
    return SimpleNamespace(main=main, started=started, fleet=ModelFleet(main, OFFERED, start))


def test_an_offered_model_gets_one_engine_started_when_first_named(engines):
    fleet = engines.fleet
    assert fleet.client_for("") is engines.main and fleet.client_for("main (embedded)") is engines.main
    assert engines.started == []  # nothing loads until an assistant names it
    other = fleet.client_for("qwen-ko")
    assert fleet.client_for("qwen-ko") is other and engines.started == ["/models/qwen-ko"]
    assert fleet.client_for("dropped-since") is engines.main  # no longer offered: the main model answers
    assert fleet.every() == [engines.main, other]
    assert "qwen-ko (ready)" in others_line(fleet)  # the console's model line names it
    assert fleet.problems() is None
    other.state, other.error = "dead", "model load failed: no such file"
    assert fleet.problems() == "qwen-ko: model load failed: no such file"  # /health says degraded, and why
    with pytest.raises(ValueError, match="does not offer the model 'llama-70b'.*'qwen-ko'"):
        fleet.check("llama-70b")
    fleet.check("qwen-ko")
    fleet.check("")


def test_a_ui_tier_on_remote_engines_offers_the_main_model_only(smol_tokenizer):
    main = FakeEngineClient(smol_tokenizer)
    fleet = ModelFleet(main, OFFERED, None)
    assert fleet.choices() == ["", "main (embedded)"] and fleet.client_for("qwen-ko") is main
    with pytest.raises(ValueError):
        fleet.check("qwen-ko")


def customer(name: str, slug: str):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}", headers={}, cookies={},
                           request=SimpleNamespace(path_params={"assistant": slug}))


def test_an_assistants_chats_are_answered_by_its_own_model_and_stop_reaches_it(engines, tmp_path):
    store = Store(str(tmp_path / "chat.db"))
    assistants.ensure_default(store)
    operator = OperatorHandlers(engines.main, store, OFFERED, None, {"olga"})
    editor = AssistantEditor(store, operator, engines.fleet)
    olga = SimpleNamespace(username="olga")
    refused = editor.save("korean", "한국어 상담", "You answer in Korean.", "", None, None, 16, None, "llama-70b",
                          request=olga)[0]
    assert refused.startswith("❌") and "does not offer" in refused and store.assistant("korean") is None
    saved = editor.save("korean", "한국어 상담", "You answer in Korean.", "", None, None, None, None, "qwen-ko",
                        request=olga)[0]
    assert saved.startswith("✅") and "qwen-ko" in saved
    assert editor.show("korean", olga)[8] == "qwen-ko"

    chat = ChatHandlers(engines.main, store, demo=False, fleet=engines.fleet)
    korean = engines.fleet.client_for("qwen-ko")

    async def turn(who, slug, text):
        uid, sid = chat.current(None, None, customer(who, slug))
        return [u async for u in chat.send(uid, sid, text, request=customer(who, slug))], uid, sid
    _, uid, sid = asyncio.run(turn("minji", "korean", "배송 언제 와요?"))
    reply = store.messages(uid, sid)[1]
    assert reply["content"].strip() == "한국어 모델입니다." and reply["model"] == "served:/models/qwen-ko"
    assert len(korean.requests) == 1 and engines.main.requests == []
    _, uid, sid = asyncio.run(turn("sam", assistants.DEFAULT_SLUG, "Where is my order?"))
    assert store.messages(uid, sid)[1]["content"].strip() == "From the main model." and len(engines.main.requests) == 1

    async def stopped():  # Stop aborts the request on the engine that runs it
        korean.gate = asyncio.Event()
        uid, sid = chat.current(None, None, customer("minji", "korean"))
        sending = asyncio.ensure_future(turn("minji", "korean", "환불은요?"))
        await asyncio.to_thread(wait_for, lambda: len(korean.requests) == 2, 10, "the second request")
        stopping = asyncio.ensure_future(chat.stop(uid, sid, customer("minji", "korean")))
        await asyncio.to_thread(wait_for, lambda: korean.aborted, 10, "the abort")
        korean.gate.set()
        await stopping
        await sending
    asyncio.run(stopped())
    assert korean.aborted and engines.main.aborted == []


def test_engines_take_turns_on_the_cpu_first_come_first_served():
    """A step waits while another engine's step runs; turns pass in the order they were asked for
    (a plain lock would let the releasing engine take it straight back)."""
    order, first_in = [], threading.Event()
    release_first = threading.Event()

    def step(name, hold=None):
        with cpu_turns.cpu_turn():
            order.append(name)
            if hold is not None:
                first_in.set()
                hold.wait(10)
    first = threading.Thread(target=step, args=("a", release_first))
    first.start()
    first_in.wait(10)
    waiting = []
    for name in ("b", "c", "d"):
        waiting.append(threading.Thread(target=step, args=(name,)))
        waiting[-1].start()
        wait_for(lambda: cpu_turns.waiting() == len(waiting), 10, f"{name} to queue")
    assert order == ["a"]  # nobody stepped beside the first
    release_first.set()
    for t in [first, *waiting]:
        t.join(10)
    assert order == ["a", "b", "c", "d"] and cpu_turns.waiting() == 0
    with cpu_turns.cpu_turn():  # free again: taken at once
        pass


def test_two_models_in_one_process_each_answers_its_assistants_chats(tiny_chat_model, tmp_path):
    """app.py with a second model offered (--models): an assistant that names it is answered by an
    engine of its own, loaded at start, while the default assistant's chats stay on the main model;
    both answer at once (their steps take turns on the CPU)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from gradio_client import Client

    from app import build_app, parse_args
    from tests.serving import LiveServer, logins_file
    from tests.test_crash import keys_file

    other = str(tmp_path / "tiny-other")
    shutil.copytree(tiny_chat_model, other)
    db = str(tmp_path / "chat.db")
    assistants.ensure_default(Store(db))
    assistants.save(Store(db), "second", {"name": "Second desk", "system_prompt": "You are the second desk.",
                                          "model": "tiny-other", "sampling": {"max_tokens": 24}}, "test")
    args = parse_args(["--db", db, "--model", tiny_chat_model, "--dtype", "float32", "--num-kv-blocks", "256",
                       "--models", other, "--auth-file", logins_file(tmp_path, a="pw", b="pw", c="pw", d="pw"),
                       "--api-key-file", keys_file(tmp_path)])
    app, llm = build_app(args)
    fleet = app.state.fleet
    try:
        with LiveServer(llm, app) as server:
            second = fleet.others()["tiny-other"]
            assert second.wait_ready(120) and second.info.name == "tiny-other"

            def ask(user, slug):
                return Client(f"{server.url}/chat/{slug}/", auth=(user, "pw"), verbose=False).predict(
                    "Where is my order?", api_name="/send")
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(ask, "abcd", ["second", assistants.DEFAULT_SLUG, "second", assistants.DEFAULT_SLUG]))
            import sqlite3

            with sqlite3.connect(db) as conn:
                rows = conn.execute("select s.assistant, m.model from messages m join sessions s on s.id = "
                                    "m.session_id where m.role = 'assistant'").fetchall()
            models = {}
            for assistant, model in rows:
                models.setdefault(assistant, set()).add(model)
            assert models == {"second": {"tiny-other"}, assistants.DEFAULT_SLUG: {llm.info.name}}
            assert b'model_name="tiny-other"' in second.metrics_text()

            import openai  # the API serves it too, by name (the official client, as a program would)

            api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test-00001")
            assert {m.id for m in api.models.list()} == {llm.info.name, "tiny-other"}
            before = (finished(second), finished(llm))
            answer = api.chat.completions.create(model="tiny-other", max_tokens=8,
                                                 messages=[{"role": "user", "content": "Hello"}])
            assert answer.model == "tiny-other" and answer.usage.completion_tokens > 0
            assert (finished(second), finished(llm)) == (before[0] + 1, before[1])  # the second engine ran it
            scrape = httpx.get(f"{server.url}/metrics").text  # one valid exposition, both models in it
            from prometheus_client.parser import text_string_to_metric_families

            done = {s.labels["model_name"]: s.value for f in text_string_to_metric_families(scrape)
                    for s in f.samples if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length"}
            assert set(done) == {llm.info.name, "tiny-other"} and done["tiny-other"] >= 1
            assert scrape.count("# TYPE vllm:request_success_total counter") == 1
            with pytest.raises(openai.NotFoundError, match="tiny-other"):
                api.completions.create(model="no-such-model", prompt="Hi", max_tokens=4)
            assert second.snapshot()["stats"]["num_running"] == 0  # both finished; nothing left stepping
    finally:
        fleet.shutdown()


def finished(client) -> float:
    """Requests the engine finished, from its Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(client.metrics_text().decode())
               for sample in family.samples if sample.name == "vllm:request_success_total")
