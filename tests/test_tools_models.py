"""Tool calls from real models: the default SmolLM2 through the official `openai` client (streamed and
not, on customer-service prompts nobody tuned for), and random-weight tiny models, whose every call
must still parse and validate: the grammar, not the model, keeps the calls whole."""
import json

import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from tests.serving import LiveServer
from ui.simulate import CUSTOMER_SERVICE_PROMPT

pytestmark = pytest.mark.e2e

ORDER = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^NW[0-9]{8}$"}},
         "required": ["order_id"], "additionalProperties": False}
TICKET = {"type": "object", "properties": {
    "topic": {"enum": ["shipping", "return", "refund", "warranty", "other"]},
    "summary": {"type": "string", "maxLength": 120}, "urgent": {"type": "boolean"}},
    "required": ["topic", "summary", "urgent"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "Status and tracking of an order.",
                                           "parameters": ORDER}},
         {"type": "function", "function": {"name": "open_ticket", "description": "Open a ticket for a person.",
                                           "parameters": TICKET}}]
SCHEMAS = {"lookup_order": ORDER, "open_ticket": TICKET}
PROMPTS = ["Where is my order NW55512345? It has been a week.", "My tent arrived with a torn seam, what now?",
           "Can I still return the boots I bought in May?", "You charged me twice!! Fix it now.",
           "주문 NW10000001 배송 상태 알려주세요"]


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(EngineConfig(num_kv_blocks=512, max_model_len=2048))
    with LiveServer(llm) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": CUSTOMER_SERVICE_PROMPT}, {"role": "user", "content": text}]


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "open_ticket"}}])
def test_required_and_named_calls_always_validate(client, stream, choice):
    for text in PROMPTS:
        # room for the longest call the grammar allows (a 120-character summary, escapes and all): a sampled
        # reply that rambles to its bound must not be cut by max_tokens, which no grammar can prevent
        kwargs = dict(model=client.models.list().data[0].id, messages=ask(text), tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=False, max_tokens=600, temperature=0.8)
        if stream:
            with client.chat.completions.stream(**kwargs) as s:
                for _ in s:
                    pass
                final = s.get_final_completion()
        else:
            final = client.chat.completions.create(**kwargs)
        choice_ = final.choices[0]
        assert choice_.finish_reason == "tool_calls", (text, choice_)
        (call,) = choice_.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "open_ticket"
        valid(call.function.name, call.function.arguments)
        assert not choice_.message.content


def test_auto_never_leaks_call_text_into_content(client):
    for text in PROMPTS[::2]:
        for stream in (False, True):
            kwargs = dict(model=client.models.list().data[0].id, messages=ask(text), tools=TOOLS, max_tokens=80,
                          seed=len(text))
            if stream:
                content, chunks = "", client.chat.completions.create(stream=True, **kwargs)
                for chunk in chunks:
                    content += chunk.choices[0].delta.content or "" if chunk.choices else ""
            else:
                reply = client.chat.completions.create(**kwargs).choices[0]
                content, calls = reply.message.content or "", reply.message.tool_calls or []
                if reply.finish_reason == "length" and calls:  # max_tokens may cut the last call: kept as written
                    assert calls[-1].function.name in SCHEMAS
                    calls = calls[:-1]
                for call in calls:
                    valid(call.function.name, call.function.arguments)
            assert "<tool_call" not in content and '"arguments"' not in content


def test_a_two_step_conversation_with_a_tool_result(client):
    model = client.models.list().data[0].id
    messages = ask("Where is my order NW55512345?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    call = first.choices[0].message.tool_calls[0]
    assert valid(call.function.name, call.function.arguments) == {"order_id": "NW55512345"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"status": "shipped", "carrier": "UPS", "eta": "Friday"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=80, temperature=0)
    answer = second.choices[0].message
    assert answer.content and not answer.tool_calls and second.choices[0].finish_reason in ("stop", "length")
    alone = client.chat.completions.create(model=model, messages=messages[:2], tools=TOOLS, tool_choice="none",
                                           max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt
    with pytest.raises(openai.BadRequestError) as e:  # a result for a call nobody made
        client.chat.completions.create(model=model, messages=messages + [
            {"role": "tool", "tool_call_id": "call_unknown", "content": "{}"}], tools=TOOLS, max_tokens=5)
    assert "tool_call_id" in e.value.body["param"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_weights_still_write_valid_calls(tiny_model, arch):
    path, _ = tiny_model(arch)
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    outs = llm.chat([[{"role": "user", "content": f"ticket {i}"}] for i in range(6)],
                    SamplingParams(temperature=1.0, max_tokens=300, seed=7), tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 3, [o.outputs[0].text[-80:] for o in outs]
    for out in finished:
        (call,) = out.tool_calls
        valid(call.name, call.arguments)
