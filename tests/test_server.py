"""The OpenAI-compatible server end to end, with the official `openai` client."""
import concurrent.futures
import json
import logging
import os
import socket
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine
from engine import EngineConfig, SamplingParams
from engine.async_llm import AsyncLLM
from engine.client import EngineDeadError
from server.auth import Credentials
from server.routes import create_app
from tests.serving import LiveServer, wait_for

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "My parcel NW20481377 is late. What should I do?"}]


@pytest.fixture(scope="module")
def live():
    llm = AsyncLLM(EngineConfig(dtype="float32", quantization="none", num_kv_blocks=1024,
                                max_model_len=2048))
    with LiveServer(llm) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def used_blocks(live) -> int:
    return live.llm.run_on_engine_thread(lambda e: e.get_stats().kv_blocks_used)


def test_chat_matches_offline_generate(client, smol32):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION,
                                           max_tokens=24, temperature=0)
    expected = smol32.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0]
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_chat_equals_whole_reply_and_reports_usage(client):
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt twice: a cache hit


def test_completions_and_models(client, smol32):
    ids = smol32.get_tokenizer().encode("The capital of France is")
    by_text = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                        max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=8, temperature=0)
    expected = smol32.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].model_extra["max_model_len"] == 2048


@pytest.mark.slow
def test_sixteen_concurrent_streams_equal_sequential_replies(client):
    def ask(i, stream):
        messages = [{"role": "user", "content": f"Customer {i} asks: where is order NW{20480000 + i}?"}]
        if not stream:
            return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                  temperature=0).choices[0].message.content
        parts = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                               temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    sequential = [ask(i, False) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_replies = list(pool.map(lambda i: ask(i, True), range(16)))
    assert concurrent_replies == sequential


def test_disconnect_mid_stream_aborts_and_frees_blocks(live):
    idle = used_blocks(live)
    body = {"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{live.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in seen)
            assert used_blocks(live) > idle
    wait_for(lambda: used_blocks(live) == idle, 30, "the aborted request's blocks to be freed")
    live.llm.run_on_engine_thread(lambda e: e.check_integrity())


def test_a_client_leaving_a_whole_reply_aborts_it_cleanly(live):
    """Not streamed: the client hangs up while the reply is being made. The request is aborted, its blocks
    freed, and the server logs no exception (closing the engine's stream while the cancelled task still
    ran in it raised "aclose(): asynchronous generator is already running" out of the handler)."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        idle = used_blocks(live)
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 1500,
                           "temperature": 0, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: used_blocks(live) > idle, 60, "the request to start")
        wait_for(lambda: used_blocks(live) == idle, 30, "the abandoned request's blocks to be freed")
        live.llm.run_on_engine_thread(lambda e: e.check_integrity())
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


def test_metrics_exist_from_the_start_and_move(live, client):
    def scrape():
        text = httpx.get(f"{live.url}/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    names = {key.split("{")[0] for key in before}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:iteration_tokens_total_bucket", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "pagedchat:kv_blocks", "pagedchat:kv_blocks_total",
                 "pagedchat:batch_size_bucket", "pagedchat:model_load_seconds", "pagedchat:resident_memory_bytes"):
        assert name in names, name
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=5, temperature=0)
    after = scrape()
    key = 'vllm:generation_tokens_total{"model_name": "SmolLM2-135M-Instruct"}'
    assert after[key] >= before[key] + 5
    stop = 'vllm:request_success_total{"finished_reason": "length", "model_name": "SmolLM2-135M-Instruct"}'
    assert after[stop] == before[stop] + 1


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"model": "SmolLM2-135M-Instruct", "messages": "hello"}, 400, "messages"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "top_p": 7}, 400, "top_p"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "n": 0}, 400, "n"),
    ({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
    ({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 4000}, 400, "max_tokens"),
    ({"model": "gpt-9", "messages": QUESTION}, 404, "model"),
])
def test_bad_input_gets_the_right_status_and_shape(live, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{live.url}/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] and error["param"].startswith(param)
    if "word " in content:
        assert "2048" in error["message"]  # the numbers are in the message
    ok = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
    assert ok.status_code == 200  # and the server keeps serving


def test_api_key_and_health(live):
    from fastapi.testclient import TestClient

    guarded = TestClient(create_app(live.llm, credentials=Credentials(keys={"s3cret-key": "shop"})))
    assert guarded.get("/v1/models").status_code == 401
    wrong = guarded.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    assert guarded.get("/health").status_code == guarded.head("/health").status_code == 200
    assert guarded.get("/ping").json() == guarded.post("/ping").json() == {"status": "ok"}  # vLLM's, no key
    assert guarded.get("/version").json() == {"version": engine.__version__}
    loading = TestClient(create_app(AsyncLLM(EngineConfig(), load=False)))
    assert loading.get("/health").status_code == loading.head("/health").status_code == 503
    assert loading.get("/ping").status_code == loading.post("/ping").status_code == 503
    assert loading.post("/v1/chat/completions", json={"messages": QUESTION}).status_code == 503


def test_overload_is_503_and_the_server_recovers(tiny_model):
    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=200, max_num_seqs=1, max_waiting=1))
    with LiveServer(llm) as server:
        hold = SamplingParams(max_tokens=3000, ignore_eos=True)
        llm.run_on_engine_thread(lambda e: e.add_request([5, 6, 7], hold, request_id="busy"))
        llm.run_on_engine_thread(lambda e: e.add_request([8, 9], hold, request_id="queued"))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        llm.run_on_engine_thread(lambda e: (e.abort_request("busy"), e.abort_request("queued")))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("streams", [[True] * 6, [False] * 6, [True, False] * 3])
def test_max_waiting_admits_the_same_number_streaming_or_not(tiny_model, streams):
    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=200, max_num_seqs=1, max_waiting=3))
    with LiveServer(llm) as server:
        llm.run_on_engine_thread(lambda e: e.add_request([5, 6, 7], SamplingParams(max_tokens=3000, ignore_eos=True),
                                                         request_id="busy"))  # holds the only running slot

        def ask(i: int, stream: bool) -> int:
            body = {"prompt": [1, 2, 3, i], "max_tokens": 2, "stream": stream}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                r.read()
                return r.status_code

        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            answers = [pool.submit(ask, i, stream) for i, stream in enumerate(streams)]
            wait_for(lambda: sum(a.done() for a in answers) == 3, 60, "the three refusals")
            assert llm.run_on_engine_thread(lambda e: e.scheduler.num_waiting) == 3
            llm.run_on_engine_thread(lambda e: e.abort_request("busy"))
            codes = sorted(a.result() for a in answers)
        assert codes == [200, 200, 200, 503, 503, 503]


def test_tokenize_detokenize_round_trip(live, smol32):
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": "Where is my parcel?"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == smol32.get_tokenizer().encode("Where is my parcel?")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == smol32.render_chat(QUESTION)
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "Where is my parcel?"
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": [-4]}).status_code == 400


def test_a_crashed_engine_loop_fails_requests_and_health(tiny_model):
    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=64))
    with LiveServer(llm) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200

        def explode():
            raise RuntimeError("scheduler bug")

        llm.run_on_engine_thread(lambda e: setattr(e.scheduler, "schedule", explode))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and "scheduler bug" in r.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "scheduler bug" in health.json()["error"]


def test_a_model_switch_never_stalls_and_replies_in_flight_finish_on_the_old_model(tiny_model, monkeypatch):
    import asyncio
    import threading

    import engine.async_llm as async_llm

    llama, _ = tiny_model("llama")
    qwen, _ = tiny_model("qwen2")
    llm = AsyncLLM(EngineConfig(model=llama, dtype="float32", num_kv_blocks=64))
    assert llm.wait_ready(120)
    loading, release = threading.Event(), threading.Event()

    def slow_load(config):  # the new model takes as long as the test says
        loading.set()
        assert release.wait(120)
        return async_llm.LLMEngine.__wrapped__(config)

    slow_load.__wrapped__ = async_llm.LLMEngine
    monkeypatch.setattr(async_llm, "LLMEngine", slow_load)

    async def scenario():
        in_flight = llm.generate([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
        assert not (await in_flight.__anext__()).finished
        switch = asyncio.ensure_future(asyncio.to_thread(llm.switch_model, qwen, None))
        await asyncio.to_thread(loading.wait, 60)
        during = await _collect(llm.generate([7, 8, 9], SamplingParams(max_tokens=5, ignore_eos=True)))
        assert not switch.done()  # answered on the old model while the new one was still loading
        with pytest.raises(ValueError, match="already in progress"):
            llm.switch_model(qwen, None)
        release.set()
        message = await switch
        last = await _collect(in_flight)
        return during, message, last

    during, message, last = asyncio.run(scenario())
    assert len(during.outputs[0].token_ids) == 5 and during.outputs[0].finish_reason == "length"
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 60  # not aborted
    assert "1 reply in flight finishes on the old model" in message and "both models loaded" in message
    assert llm.info.name == os.path.basename(qwen)
    assert llm.run_on_engine_thread(lambda e: e.hf_config.model_type) == "qwen2"
    done = asyncio.run(_collect(llm.generate([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))))
    assert len(done.outputs[0].token_ids) == 3
    llm.shutdown()


def test_a_failed_switch_leaves_the_old_model_serving(tiny_model, tmp_path):
    import asyncio

    llama, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=llama, dtype="float32", num_kv_blocks=64))
    assert llm.wait_ready(120)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="could not load"):
        llm.switch_model(str(tmp_path / "broken.gguf"), None)
    done = asyncio.run(_collect(llm.generate([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))))
    assert len(done.outputs[0].token_ids) == 3 and llm.info.name == os.path.basename(llama)
    llm.shutdown()


def test_an_abort_from_elsewhere_ends_the_only_stream_with_its_final_output(tiny_model):
    """The chat's Stop aborts by request id while the turn reads the stream: even when it was the
    engine's only request (nothing left to step), the stream gets its final "abort" output."""
    import asyncio

    llama, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=llama, dtype="float32", num_kv_blocks=64))
    assert llm.wait_ready(120)

    async def read():
        outs = []
        async for out in llm.generate([5, 6, 7], SamplingParams(max_tokens=3000, ignore_eos=True), request_id="chat"):
            outs.append(out)
            if len(outs) == 3:
                llm.abort("chat")
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(read(), 60))
    finally:
        llm.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 3000


def test_a_stream_whose_event_loop_closed_is_aborted_and_the_engine_lives_on(tiny_model):
    """A server stopped mid-reply closes its event loop under a running request: the engine thread
    aborts that request (its blocks freed) instead of dying on the closed loop, and serves on."""
    import asyncio

    llama, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=llama, dtype="float32", num_kv_blocks=64))
    assert llm.wait_ready(120)
    gone = asyncio.new_event_loop()
    orphan = llm.generate([5, 6, 7], SamplingParams(max_tokens=3000, ignore_eos=True), request_id="orphan")
    try:
        gone.run_until_complete(orphan.__anext__())
        gone.close()  # no shutdown of async generators: the stream is left as a killed server leaves it
        done = asyncio.run(asyncio.wait_for(_collect(llm.generate([1, 2], SamplingParams(max_tokens=3))), 60))
        stats = llm.run_on_engine_thread(lambda e: e.get_stats())
        assert llm.ready and llm.error is None
    finally:
        llm.shutdown()
    assert done.finished and len(done.outputs[0].token_ids) == 3
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


def test_a_request_queued_behind_a_command_that_crashes_the_loop_fails_instead_of_hanging(tiny_model):
    import asyncio

    llama, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=llama, dtype="float32", num_kv_blocks=64))
    assert llm.wait_ready(120)

    def explode(request_id):
        raise RuntimeError("abort bug")

    llm.run_on_engine_thread(lambda e: setattr(e, "abort_request", explode))
    busy, gate = threading.Event(), threading.Event()
    blocker = threading.Thread(target=llm.run_on_engine_thread, args=(lambda e: busy.set() or gate.wait(60),))
    blocker.start()
    assert busy.wait(60)  # the engine thread is inside the blocker; what comes next queues behind it

    async def ask():
        llm.abort("nobody")  # will crash the loop
        first = asyncio.ensure_future(llm.generate([1, 2], SamplingParams(max_tokens=3)).__anext__())
        asyncio.get_running_loop().call_soon(gate.set)  # runs after `first` has queued its request
        return await first

    try:
        with pytest.raises(EngineDeadError, match="abort bug"):
            asyncio.run(asyncio.wait_for(ask(), 60))
    finally:
        gate.set()
        blocker.join(60)
        llm.shutdown()


async def _collect(stream):
    last = None
    async for last in stream:
        pass
    return last
