"""The public API's contracts: validation, clear errors that leave the engine serving, priority,
abort, back-pressure. Runs on a tiny random-weight Llama (fast to load)."""
import pytest

from engine import LLM, EngineConfig, EngineOverloadedError, SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, dtype="float32", num_kv_blocks=32, max_model_len=256)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 65), ("temperature", -0.1), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5),
])
def test_each_bad_sampling_value_is_a_clear_error(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.mark.parametrize("field, value", [
    ("block_size", 8), ("dtype", "int3"), ("device", "tpu"), ("max_num_seqs", 0),
    ("max_num_batched_tokens", -1), ("scheduling_policy", "lifo"), ("num_kv_blocks", 1),
    ("max_model_len", 0), ("quantization", "fp3"), ("num_threads", 0), ("int8_activations", "yes"),
])
def test_each_bad_engine_value_is_a_clear_error(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="not found"):
        LLM("./no/such/folder")


def test_bad_requests_leave_the_engine_serving(tiny):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([[]], good)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        tiny.generate([[5] * 300], good)
    with pytest.raises(ValueError, match="token ids"):
        tiny.generate([[5, 10**9]], good)
    with pytest.raises(ValueError, match="must match"):
        tiny.generate(["a", "b"], [good])
    out = tiny.generate([[5, 6, 7]], good)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert tiny.get_stats().kv_blocks_used == 0
    tiny.engine.check_integrity()


def test_generation_stops_at_max_model_len(tiny):
    out = tiny.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_request_finishes_first_when_the_pool_is_saturated(policy, tiny_model):
    path, _ = tiny_model("llama")
    engine = LLM(path, dtype="float32", num_kv_blocks=32, scheduling_policy=policy).engine
    low = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(4):  # 4 x (100 + 60) tokens need 40 blocks of 16: more than the pool holds
        engine.add_request([100 + i] * 100, low, request_id=f"low{i}", priority=10)
    for _ in range(3):
        engine.step()
    engine.add_request([7] * 100, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       request_id="vip", priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert (finished[0] == "vip") == (policy == "priority"), finished
    assert engine.get_stats().num_preemptions > 0
    engine.check_integrity()


def test_abort_frees_blocks_and_reports_abort(tiny):
    engine = tiny.engine
    engine.add_request([9] * 50, SamplingParams(max_tokens=100, ignore_eos=True), request_id="gone")
    engine.step()
    assert engine.get_stats().kv_blocks_used > 0
    assert engine.abort_request("gone")
    assert engine.get_stats().kv_blocks_used == 0
    assert engine.has_unfinished_requests()  # the only request, aborted: its final output is still to come
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("gone", "abort")]
    assert not engine.abort_request("gone") and not engine.has_unfinished_requests()


def test_full_waiting_queue_refuses_with_overloaded(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=16, max_waiting=2)
    llm.engine.add_request([1, 2], request_id="a")
    llm.engine.add_request([1, 2], request_id="b")
    with pytest.raises(EngineOverloadedError, match="overloaded"):
        llm.engine.add_request([1, 2], request_id="c")
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request([1, 2], request_id="a")


@pytest.mark.parametrize("field, value", [
    ("seed", 2**70), ("seed", -2**64), ("temperature", float("inf")), ("temperature", float("nan")),
    ("repetition_penalty", float("inf")),
])
def test_values_the_engine_cannot_run_are_refused_at_admission(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny.generate([[1, 2, 3]], SamplingParams(stop_token_ids=[10**9]))
    tiny.engine.check_integrity()


def test_one_poisoned_request_fails_alone_and_the_batch_goes_on(tiny):
    """A request whose sampling fails at run time (its seed corrupted after validation) ends with
    an error; the 8 healthy greedy requests beside it produce exactly what they produce alone."""
    prompts = [[10 + i, 20 + i, 30 + i] * (4 + i) for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(prompts, greedy)]
    poisoned = SamplingParams(temperature=0.8, max_tokens=12, seed=1)
    poisoned.seed = 2**70  # what validation would have refused
    outs = tiny.generate(prompts[:4] + [[5, 6, 7]] + prompts[4:], [greedy] * 4 + [poisoned] + [greedy] * 4)
    assert outs[4].outputs[0].finish_reason == "error" and "sampling failed" in outs[4].error
    assert [o.outputs[0].token_ids for o in outs[:4] + outs[5:]] == alone
    again = tiny.generate([prompts[7]], greedy)[0]
    assert again.num_cached_tokens > 0  # the prefix cache was not reset by the fault
    tiny.engine.check_integrity()
