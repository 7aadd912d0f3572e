"""Assistants: what an operator defines for a deployment (name, system prompt, greeting, sampling,
model, tools), stored as versions in SQLite (storage/store.py). A chat keeps the version it started with;
an edit applies to new chats. Customers pick none of it: an assistant is served at
/chat/<slug>, and its prompt and sampling never reach a customer's browser."""
from __future__ import annotations

import re

from engine.errors import ParameterError
from engine.sampling_params import SamplingParams
from storage import orders
from ui import actions, hours
from ui.grounding import DEFAULT_K
from ui.simulate import CUSTOMER_SERVICE_PROMPT

DEFAULT_SLUG = "support"
SLUG = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
MAX_PROMPT_CHARS, MAX_GREETING_CHARS, MAX_NAME_CHARS = 20_000, 2_000, 80
MAX_QUICK_REPLIES, MAX_QUICK_REPLY_CHARS = 8, 80
MAX_CANNED, MAX_CANNED_CHARS = 50, 2_000
MAX_CHUNKS = 8
SHORTCUT = re.compile(r"/[a-z0-9][a-z0-9_-]{0,29}")
# The chat's own sampling default beside the model's: with SmolLM2's card values alone (temperature
# 0.2, top-p 0.9) 5 of 6 second replies looped, a sentence repeated 12-36 times; with 1.1, none did.
CHAT_REPETITION_PENALTY = 1.1
SAMPLING_RANGES = {"temperature": (0, 2), "top_p": (0.01, 1), "max_tokens": (1, 4096), "repetition_penalty": (1, 2)}
SAMPLING_KEYS = tuple(SAMPLING_RANGES)

DEFAULT = {"name": "Sam, Northwind Outfitters support", "system_prompt": CUSTOMER_SERVICE_PROMPT,
           "greeting": "Hi, I'm Sam from Northwind Outfitters. How can I help you today?",
           "sampling": {"max_tokens": 256, "repetition_penalty": CHAT_REPETITION_PENALTY}, "model": "",
           "quick_replies": ["Where is my order NW20481377? My e-mail is dana@example.com", "How do I return an item?", "주문 조회", "Talk to a person"],
           "tools": actions.DEFAULT_TOOLS,
           "canned": {"/label": "I have emailed you a prepaid return label; drop the parcel at any post office "
                                "within thirty days.",
                      "/refund": "Refunds go back to your original payment method within five to seven business "
                                 "days after the return arrives.",
                      "/bye": "Thank you for contacting Northwind Outfitters. Have a great day outdoors!"}}


def check(slug: str, fields: dict) -> dict:
    """An assistant's fields, cleaned; ParameterError naming the field that is wrong. Sampling keys
    left out take the model's defaults at each turn."""
    if not isinstance(slug, str) or not SLUG.fullmatch(slug):
        raise ParameterError("the assistant's address must be 1-40 lowercase letters, digits or dashes "
                             f"(it becomes /chat/<address>), got {slug!r}", "slug")
    name = str(fields.get("name") or "").strip()
    if not name or len(name) > MAX_NAME_CHARS:
        raise ParameterError(f"the name must be 1-{MAX_NAME_CHARS} characters", "name")
    prompt = str(fields.get("system_prompt") or "")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ParameterError(f"the system prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}",
                             "system_prompt")
    greeting = str(fields.get("greeting") or "")
    if len(greeting) > MAX_GREETING_CHARS:
        raise ParameterError(f"the greeting is {len(greeting)} characters; at most {MAX_GREETING_CHARS}", "greeting")
    sampling = {k: v for k, v in (fields.get("sampling") or {}).items() if v is not None}
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise ParameterError(f"unknown sampling settings {sorted(unknown)}; known: {SAMPLING_KEYS}", "sampling")
    for key, value in sampling.items():
        low, high = SAMPLING_RANGES[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
            raise ParameterError(f"{key} must be a number in [{low}, {high}], got {value!r}", key)
    if "max_tokens" in sampling:
        sampling["max_tokens"] = int(sampling["max_tokens"])
    SamplingParams(**sampling)  # what the engine would refuse besides
    return {"name": name, "system_prompt": prompt, "greeting": greeting, "sampling": sampling,
            "model": str(fields.get("model") or ""), "quick_replies": _quick_replies(fields.get("quick_replies")),
            "canned": _canned(fields.get("canned")), "tools": actions.check(fields.get("tools")),
            "knowledge": _knowledge(fields.get("knowledge")), "hours": _hours(fields.get("hours"))}


def _hours(text) -> str:
    """The team hours as written, once they parse (ui/hours.py); "" for none."""
    text = str(text or "").strip()
    hours.parse(text)
    return text


def _knowledge(settings) -> dict:
    """How many chunks of the assistant's documents a turn takes (0: none), and the least relevance."""
    settings = {k: v for k, v in (settings or {}).items() if v is not None}
    k, low = settings.get("k", DEFAULT_K), settings.get("min_score", 0.0)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_CHUNKS:
        raise ParameterError(f"knowledge chunks per turn must be an integer in [0, {MAX_CHUNKS}], got {k!r}",
                             "knowledge")
    if not isinstance(low, (int, float)) or isinstance(low, bool) or low < 0:
        raise ParameterError(f"the least relevance must be a number >= 0, got {low!r}", "knowledge")
    return {"k": k, "min_score": float(low)}


def _quick_replies(items) -> list[str]:
    replies = [str(q).strip() for q in (items or []) if str(q).strip()]
    if len(replies) > MAX_QUICK_REPLIES:
        raise ParameterError(f"at most {MAX_QUICK_REPLIES} quick replies, got {len(replies)}", "quick_replies")
    long = [q for q in replies if len(q) > MAX_QUICK_REPLY_CHARS]
    if long:
        raise ParameterError(f"a quick reply is at most {MAX_QUICK_REPLY_CHARS} characters: {long[0][:40]!r}…",
                             "quick_replies")
    return replies


def _canned(items) -> dict[str, str]:
    canned = {str(k).strip(): str(v).strip() for k, v in (items or {}).items()}
    if len(canned) > MAX_CANNED:
        raise ParameterError(f"at most {MAX_CANNED} canned responses, got {len(canned)}", "canned")
    for shortcut, text in canned.items():
        if not SHORTCUT.fullmatch(shortcut):
            raise ParameterError(f"a shortcut is / and 1-30 lowercase letters, digits, - or _, got {shortcut!r}",
                                 "canned")
        if not text or len(text) > MAX_CANNED_CHARS:
            raise ParameterError(f"the canned response {shortcut} is {len(text)} characters; it needs 1 to "
                                 f"{MAX_CANNED_CHARS}", "canned")
    return canned


def parse_canned(text: str) -> dict[str, str]:
    """The editor's lines `/shortcut: the response` -> {shortcut: response}; ParameterError for a bad line."""
    canned = {}
    for n, line in enumerate((text or "").splitlines(), 1):
        if not line.strip():
            continue
        shortcut, sep, response = line.partition(":")
        if not sep:
            raise ParameterError(f"canned responses, line {n}: write it as `/shortcut: the response`", "canned")
        canned[shortcut.strip()] = response.strip()
    return canned


def format_canned(canned: dict[str, str]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in canned.items())


def save(store, slug: str, fields: dict, by: str) -> int:
    """Check and store a new version; returns its number."""
    return store.save_assistant(slug, check(slug, fields), by)


def ensure_default(store) -> None:
    """A new database gets the shipped assistant, so /chat/support answers from the first start, and
    the sample orders its lookup_order reads."""
    if not store.assistants():
        save(store, DEFAULT_SLUG, DEFAULT, "pagedchat")
        orders.seed_sample(store)


def sampling_for(info, assistant: dict) -> SamplingParams:
    """The assistant's sampling over the model's own defaults (engine.client.ModelInfo)."""
    values = {"repetition_penalty": CHAT_REPETITION_PENALTY, "max_tokens": 256, **assistant["sampling"]}
    return info.default_sampling(**values)
