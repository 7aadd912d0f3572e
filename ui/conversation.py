"""Token-exact continuation: a turn's prompt is the token ids the engine saw last turn (prompt +
reply) followed by only the new turn, rendered by the chat template. The whole history is then a
prefix the engine has cached, token for token."""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("pagedchat.conversation")

@dataclass
class Prompt:
    token_ids: list[int]
    reused: int  # tokens taken as they were from the previous turn
    fallback: str | None = None  # why the whole conversation was rendered again, if it was


def chat_messages(system_prompt: str, history: list[dict]) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": m["role"], "content": m["content"]} for m in history]


def build_prompt(tokenizer, system_prompt: str, history: list[dict], new_text: str, model: str) -> Prompt:
    """history: stored messages (role, content, token_ids, model), oldest first. The last user
    message's token_ids are that turn's whole prompt; an assistant message's, its reply."""
    messages = chat_messages(system_prompt, history) + [{"role": "user", "content": new_text}]
    full_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    previous = _previous_context(history)
    if previous is None:
        return Prompt(tokenizer.encode(full_text, add_special_tokens=False), 0)
    context_ids, context_model = previous
    if context_model != model:
        return _fallback(tokenizer, full_text, f"model changed from {context_model!r} to {model!r}")
    context_text = tokenizer.decode(context_ids, skip_special_tokens=False)
    if not full_text.startswith(context_text):
        at = next((i for i, (a, b) in enumerate(zip(full_text, context_text)) if a != b),
                  min(len(full_text), len(context_text)))
        return _fallback(tokenizer, full_text, f"stored tokens diverge from the template at character {at}: "
                                               f"{context_text[at:at + 30]!r} vs {full_text[at:at + 30]!r}")
    suffix = tokenizer.encode(full_text[len(context_text):], add_special_tokens=False)
    return Prompt(context_ids + suffix, len(context_ids))


def _previous_context(history: list[dict]) -> tuple[list[int], str] | None:
    if len(history) < 2 or history[-1]["role"] != "assistant" or history[-2]["role"] != "user":
        return None
    user, reply = history[-2], history[-1]
    if not user["token_ids"] or not reply["token_ids"]:
        return None
    return user["token_ids"] + reply["token_ids"], reply.get("model") or ""


def _fallback(tokenizer, full_text: str, why: str) -> Prompt:
    log.info("full re-render of the conversation: %s", why)
    return Prompt(tokenizer.encode(full_text, add_special_tokens=False), 0, why)
