"""Log probabilities, structured outputs and logit masks through the official `openai` client against
a live server on the real model, streaming and not; the Responses API, and Anthropic's Messages API
through the official `anthropic` client."""
import json

import anthropic
import openai
import pytest

from engine import EngineConfig, SamplingParams
from engine.async_llm import AsyncLLM
from tests.serving import LiveServer
from tests.test_logprobs_and_constraints import ORDER_SCHEMA, PASSAGE, check_order

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "My parcel NW20481377 is late. What should I do?"}]
EXTRACT = [{"role": "system", "content": "Extract the order number, the product and the customer's intent as JSON."},
           {"role": "user", "content": "Order NW55512345: the two-person tent leaks. I would like a new one."}]


@pytest.fixture(scope="module")
def live():
    with LiveServer(AsyncLLM(EngineConfig(dtype="float32", quantization="none", num_kv_blocks=512,
                                          max_model_len=2048))) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_logprobs_match_the_engine_streamed_or_not(client, smol32):
    whole = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    engine = smol32.generate([smol32.render_chat(QUESTION)],
                             SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0].outputs[0]
    assert len(content) == len(engine.token_ids)
    for item, token, entry in zip(content, engine.token_ids, engine.logprobs):
        assert abs(item.logprob - entry[token].logprob) < 1e-4 and item.token == entry[token].decoded_token
        assert [t.token for t in item.top_logprobs] == [e.decoded_token for e in
                                                        sorted(entry.values(), key=lambda e: e.rank)][:3]
    stream = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4  # the second run hits the cache


def test_completion_echo_scores_the_prompt_like_the_engine(client, smol32):
    r = client.completions.create(model=model(client), prompt=PASSAGE, max_tokens=3, temperature=0, logprobs=2,
                                  echo=True)
    scores = r.choices[0].logprobs
    ids = smol32.get_tokenizer().encode(PASSAGE)
    engine = smol32.generate([ids], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=2))[0]
    assert scores.token_logprobs[0] is None and len(scores.tokens) == len(ids) + 3
    expected = [entry[t].logprob for entry, t in zip(engine.prompt_logprobs[1:], ids[1:])]
    expected += [entry[t].logprob for entry, t in zip(engine.outputs[0].logprobs, engine.outputs[0].token_ids)]
    assert max(abs(a - b) for a, b in zip(scores.token_logprobs[1:], expected)) < 1e-4
    assert r.choices[0].text.startswith(PASSAGE) and "".join(scores.tokens) == r.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_always_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=model(client), messages=EXTRACT, max_tokens=120, temperature=0.8,
                                           seed=seed, response_format=fmt, stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else \
            r.choices[0].message.content
        check_order(text)


def test_json_object_choice_and_logit_bias(client):
    r = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=80, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=model(client), prompt="The customer wants a", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["refund", "replacement"]}})
    assert r.choices[0].text in ("refund", "replacement")
    biased = client.completions.create(model=model(client), prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={"33": 100}, extra_body={"return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"] == [33, 33, 33]


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "[0-9+"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_bad_constraints_are_a_400_that_says_why(client, live, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param and len(e.value.body["message"]) > 15
    assert live.llm.run_on_engine_thread(lambda eng: eng.get_stats().kv_blocks_used) == 0


def test_n_choices_whole_and_streamed(client, live):
    whole = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=8, temperature=1.0,
                                           seed=3, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2] and all(c.message.content for c in whole.choices)
    assert whole.usage.completion_tokens == 3 * 8
    stream = client.chat.completions.create(model=model(client), messages=QUESTION, max_tokens=8, temperature=1.0,
                                            seed=3, n=3, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, finished, used = {0: "", 1: "", 2: ""}, set(), None
    for chunk in stream:
        if chunk.usage:
            used = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert used.completion_tokens == whole.usage.completion_tokens
    batch = client.completions.create(model=model(client), prompt=["Hello", "Thanks"], max_tokens=4, n=2,
                                      temperature=1.0, seed=1)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert live.llm.run_on_engine_thread(lambda eng: eng.get_stats().kv_blocks_used) == 0


def test_streamed_completions_keep_each_choices_echo_and_logprobs_apart(client):
    stream = client.completions.create(model=model(client), prompt="Our tents", max_tokens=6, n=2, temperature=1.0,
                                       seed=2, echo=True, logprobs=1, stream=True)
    text, tokens, offsets = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            if c.logprobs:
                tokens[c.index] += c.logprobs.tokens
                offsets[c.index] += c.logprobs.text_offset
    for i in (0, 1):
        assert text[i].startswith("Our tents") and "".join(tokens[i]) == text[i]
        assert offsets[i][0] == 0 and offsets[i] == sorted(offsets[i])


def test_responses_continue_a_conversation_from_the_cache_as_the_chat_route_would(client, live):
    """/v1/responses on the real model: the same greedy reply as the chat route for the same
    conversation, the stored conversation's prompt a prefix-cache hit, and the streamed response
    equal to the whole one."""
    agent = "You are a shop's support agent."  # instructions are not carried over: each request sends them
    first = client.responses.create(model=model(client), input=QUESTION[0]["content"], temperature=0,
                                    max_output_tokens=20, instructions=agent)
    second = client.responses.create(model=model(client), input="Thank you. Can I change the address?",
                                     previous_response_id=first.id, temperature=0, max_output_tokens=20,
                                     instructions=agent)
    messages = [{"role": "system", "content": agent}, *QUESTION, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Thank you. Can I change the address?"}]
    chat = client.chat.completions.create(model=model(client), messages=messages, temperature=0, max_tokens=20)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    details = second.usage.input_tokens_details
    assert details.cached_tokens >= first.usage.input_tokens // 16 * 16 and details.cache_write_tokens >= 16
    stream = client.responses.create(model=model(client), input=QUESTION[0]["content"], temperature=0,
                                     max_output_tokens=30, stream=True)
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    whole = client.responses.create(model=model(client), input=QUESTION[0]["content"], temperature=0,
                                    max_output_tokens=30)
    final = events[-1].response  # response.completed, or response.incomplete where 30 tokens cut it
    assert events[-1].type == f"response.{final.status}" and final.status == whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert live.llm.run_on_engine_thread(lambda eng: eng.get_stats().kv_blocks_used) == 0


def test_the_real_model_answers_through_the_anthropic_client(client, live):
    """Anthropic's Messages API on the real model: the same greedy reply as the chat route, a repeated
    conversation read from the prefix cache (cache_read_input_tokens), and the stream equal to the whole."""
    claude = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    agent, greedy = "You are a shop's support agent.", {"temperature": 0}
    first = claude.messages.create(model=model(client), max_tokens=30, system=agent, messages=QUESTION,
                                   extra_body=greedy)
    chat = client.chat.completions.create(model=model(client), max_tokens=30, temperature=0,
                                          messages=[{"role": "system", "content": agent}, *QUESTION])
    assert first.content[0].text == chat.choices[0].message.content
    assert first.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    with claude.messages.stream(model=model(client), max_tokens=30, system=agent, messages=QUESTION,
                                extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == first.content[0].text
    assert final.usage.cache_read_input_tokens >= 16  # the requests before it had the same prompt
    assert live.llm.run_on_engine_thread(lambda eng: eng.get_stats().kv_blocks_used) == 0
