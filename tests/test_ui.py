"""The chat UI's events through gradio_client against the real app (API + Gradio on one port)."""
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from app import build_app, parse_args
from storage import Store
from tests.serving import LiveServer, logins_file, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ui")
    db = str(folder / "chat.db")
    (folder / "broken.gguf").write_bytes(b"GGUF but not really")
    args = parse_args(["--demo", "--db", db, "--auth-file", logins_file(folder, alice="pw-a", bob="pw-b"), "--admin", "alice",
                       "--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "2048",
                       "--models", str(folder / "broken.gguf")])
    app, llm = build_app(args)
    with LiveServer(llm, app) as server:
        server.store = Store(db)
        yield server


def client(ui, who: str) -> Client:
    return Client(ui.url, auth=(who, f"pw-{who[0]}"), verbose=False)


def sessions_of(store: Store, who: str) -> list[dict]:
    return store.sessions(f"login:{who}")


def test_send_streams_and_stores_the_turn_with_token_ids(ui):
    alice = client(ui, "alice")
    job = alice.submit("Hello, where is my parcel?", 0.0, 1.0, 48, api_name="/send")
    updates = list(job)
    final_chat = updates[-1][0]
    assert len(updates) > 3  # streamed: many partial updates before the end
    assert final_chat[-1]["role"] == "assistant" and "generated" in str(final_chat[-1]["content"])
    session = sessions_of(ui.store, "alice")[0]
    msgs = ui.store.messages("login:alice", session["id"])
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[0]["token_ids"] and msgs[1]["token_ids"] and msgs[1]["generated_tokens"] == len(msgs[1]["token_ids"])
    assert session["title"].startswith("Hello, where is my parcel")


def test_stop_aborts_and_keeps_the_partial_reply(ui):
    bob = client(ui, "bob")
    bob.predict("", api_name="/new_chat")
    job = bob.submit("Tell me a very long story about a lost parcel.", 0.0, 1.0, 1000, api_name="/send")
    wait_for(lambda: len(job.outputs()) >= 3, 120, "the reply to start streaming")
    job.cancel()
    wait_for(lambda: ui.llm.run_on_engine_thread(lambda e: e.get_stats().num_running) == 0, 60, "the request to be aborted")
    def last():  # a reply is stored as "streaming" while it grows, then with how it ended
        return ui.store.messages("login:bob", sessions_of(ui.store, "bob")[0]["id"])[-1]
    wait_for(lambda: last()["role"] == "assistant" and last()["finish_reason"] != "streaming", 60,
             "the partial reply to be stored")
    reply = last()
    assert reply["finish_reason"] == "abort" and 0 < reply["generated_tokens"] < 1000
    assert ui.llm.run_on_engine_thread(lambda e: e.get_stats().kv_blocks_used) == 0


def test_regenerate_replaces_the_last_reply(ui):
    alice = client(ui, "alice")
    alice.predict("What are your opening hours?", 0.0, 1.0, 24, api_name="/send")
    sid = sessions_of(ui.store, "alice")[0]["id"]
    before = ui.store.messages("login:alice", sid)
    alice.predict(0.9, 1.0, 24, api_name="/regenerate")
    after = ui.store.messages("login:alice", sid)
    assert len(after) == len(before)
    assert after[-1]["created"] > before[-1]["created"] and after[-2] == before[-2]


def test_switching_sessions_and_per_user_isolation(ui):
    alice = client(ui, "alice")
    first = sessions_of(ui.store, "alice")[-1]["id"]
    alice.predict("", api_name="/new_chat")
    alice.predict("Second chat here", 0.0, 1.0, 16, api_name="/send")
    assert len(sessions_of(ui.store, "alice")) >= 2
    opened = alice.predict(first, api_name="/open_session")
    chat, _system, _title = opened  # State outputs are not part of the API result
    assert any("parcel" in str(m["content"]) for m in chat)  # the first chat's history came back
    bob = client(ui, "bob")
    alice_ids = {s["id"] for s in sessions_of(ui.store, "alice")}
    bob_sees = {choice[1] for choice in bob.predict("", api_name="/find")["choices"]}
    assert bob_sees and not bob_sees & alice_ids
    assert bob.predict("opening hours", api_name="/find")["choices"] == []  # only alice asked that
    try:  # Gradio itself refuses a session id that is not among bob's choices...
        snooped_chat = bob.predict(first, api_name="/open_session")[0]
    except AppError:
        snooped_chat = []
    # ...and were it let through, the store answers only for sessions bob owns.
    assert not any("opening hours" in str(m.get("content", "")) for m in (snooped_chat or []) if isinstance(m, dict))
    assert ui.store.session("login:bob", first) is None


def test_overlong_message_is_refused_and_kept_in_the_box(ui):
    alice = client(ui, "alice")
    huge = "refund " * 15000  # ~100 kB, far past max_model_len
    chat, box = alice.predict(huge, 0.0, 1.0, 16, api_name="/send")
    assert box == huge
    assert ui.llm.run_on_engine_thread(lambda e: e.get_stats().kv_blocks_used) == 0


def test_switching_to_a_model_that_fails_keeps_the_old_one_serving(ui):
    alice = client(ui, "alice")
    status = alice.predict("broken.gguf", "none", api_name="/switch")
    assert "could not load" in status and "Still serving **SmolLM2-135M-Instruct**" in status
    chat, _ = alice.predict("Still there?", 0.0, 1.0, 16, api_name="/send")
    assert "generated" in str(chat[-1]["content"])


def test_only_an_operator_resets_the_prefix_cache(ui):
    alice, bob = client(ui, "alice"), client(ui, "bob")
    alice.predict("What are your opening hours?", 0.0, 1.0, 16, api_name="/send")
    cached = lambda: ui.llm.run_on_engine_thread(lambda e: e.get_stats().kv_blocks_cached)  # noqa: E731
    assert cached() > 0
    with pytest.raises(AppError, match="Only operators"):
        bob.predict(api_name="/reset_prefix_cache")
    assert cached() > 0
    assert alice.predict(api_name="/reset_prefix_cache").startswith("✅")
    assert cached() == 0


@pytest.mark.slow
def test_operator_quantizes_with_our_gptq_and_switches(ui, gptq_cache, gptq_lock, monkeypatch):
    """The operator's "gptq (quantize now)": our GPTQ runs once (or, after test_quant_formats, its
    cached checkpoint is found), the checkpoint loads, and chats go on."""
    monkeypatch.setenv("PAGEDCHAT_CACHE", gptq_cache)
    alice = client(ui, "alice")
    label = "SmolLM2-135M-Instruct (embedded)"
    choices = alice.predict(label, api_name="/quant_options")["choices"]
    assert ["gptq (quantize now)", "gptq (quantize now)"] in choices
    with gptq_lock:
        status = alice.predict(label, "gptq (quantize now)", api_name="/switch")
    assert status.startswith("✅") and "loaded" in status
    assert ui.llm.info.quantization.startswith("gptq")  # "(dequantized)" in this fp32 fixture
    chat, _ = alice.predict("Hello again", 0.0, 1.0, 16, api_name="/send")
    assert "generated" in str(chat[-1]["content"])
