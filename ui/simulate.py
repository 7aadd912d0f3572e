"""Simulated customers: bounded chats that share the product's customer-service system prompt and
resend their whole history every turn, so one visitor can watch batching and the prefix cache.
The same seeded workload drives the benchmarks and the prefix-caching tests."""
from __future__ import annotations

import asyncio
import random
import uuid

from engine.client import EngineClient
from engine.sampling_params import SamplingParams

CUSTOMER_SERVICE_PROMPT = (
    "You are Sam, the customer service assistant of Northwind Outfitters, an online shop for outdoor "
    "clothing, tents, backpacks and camping gear. Answer politely, briefly and accurately. Our policies: "
    "orders ship within two business days from our warehouse in Denver, Colorado; standard shipping takes "
    "three to five business days and is free for orders over fifty dollars; express shipping takes one to "
    "two business days and costs fifteen dollars. Customers may return unused items within thirty days of "
    "delivery for a full refund; worn or used items can be exchanged within thirty days if they are "
    "defective. Refunds go back to the original payment method within five to seven business days after "
    "the return arrives. Every tent and backpack carries a two-year warranty against manufacturing defects; "
    "the warranty does not cover wear and tear, misuse or damage from fire. To start a return, the customer "
    "needs the order number, which begins with NW and has eight digits, and the email address used at "
    "checkout. Never ask for full card numbers or passwords. If a customer is angry, apologise once, then "
    "focus on solving the problem. If you cannot solve a problem, offer to open a ticket with a human "
    "agent, who will reply by email within one business day. Our support hours are eight in the morning to "
    "eight in the evening, Mountain Time, Monday to Saturday. Do not invent discounts, promotions or "
    "delivery dates that are not stated here. "
    "End every answer by asking whether there is anything else you can help with today."
)

_SUBJECTS = ["my order NW20481377", "the blue hiking backpack", "a two-person tent", "my rain jacket",
             "the sleeping bag I bought", "my refund", "express shipping", "a gift card", "the warranty",
             "my account email", "a damaged parcel", "the camping stove"]
_ASKS = ["has not arrived yet and the tracking page has not changed for four days",
         "arrived with a broken zipper and I would like to know what my options are",
         "is too small, so can I exchange it for a larger size without paying shipping again",
         "was charged twice on my credit card statement this morning",
         "does not match the colour shown on your website at all",
         "needs to go to a different address because I am moving next week",
         "started leaking during the first night of our camping trip in the rain",
         "was supposed to come with a stuff sack but the box only had the tent inside"]
_FOLLOW_UPS = ["Thanks. How long will that take exactly?", "Can you open a ticket with a human agent for me?",
               "What information do you need from me to get this started?",
               "Is there anything I should do with the item in the meantime?",
               "OK. And will I get an email confirmation once it is done?"]


def user_turns(session: int, turns: int, seed: int = 0) -> list[str]:
    """Deterministic user messages of roughly 20-60 tokens for one session."""
    rng = random.Random(seed * 100_003 + session)
    first = (f"Hello, I need help with {rng.choice(_SUBJECTS)}. It {rng.choice(_ASKS)}. "
             f"I ordered it {rng.randint(2, 20)} days ago and I would really like this sorted out soon.")
    return [first] + [rng.choice(_FOLLOW_UPS) for _ in range(turns - 1)]


_background: set[asyncio.Task] = set()  # running simulated chats (kept referenced until they end)


def start_simulated_chats(client: EngineClient, n: int, turns: int = 3) -> int:
    """Start n bounded chats on the running event loop; returns how many were started."""
    n = max(1, min(int(n), 64))
    for i in range(n):
        task = asyncio.get_running_loop().create_task(simulated_chat(client, i, turns))
        _background.add(task)
        task.add_done_callback(_background.discard)
    return n


async def simulated_chat(client: EngineClient, index: int, turns: int = 3) -> None:
    """One customer: the shared system prompt, a growing history, then it leaves."""
    tok = client.info.tokenizer
    messages = [{"role": "system", "content": CUSTOMER_SERVICE_PROMPT}]
    params = SamplingParams(temperature=0.7, max_tokens=64, seed=index)
    session = f"sim-{uuid.uuid4().hex[:8]}"
    for text in user_turns(index, turns, seed=int(uuid.uuid4().int % 1000)):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        reply = ""
        try:
            async for out in client.generate(ids, params, session_id=session):
                reply = out.outputs[0].text
        except Exception:  # noqa: BLE001 - a simulated customer just leaves
            return
        messages.append({"role": "assistant", "content": reply})
