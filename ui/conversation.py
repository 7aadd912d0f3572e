"""Token-exact continuation: a turn's prompt is the token ids the engine saw last turn (prompt +
reply) followed by only the new turn, rendered by the chat template. The whole history is then a
prefix the engine has cached, token for token.

A conversation that outgrows the model's context drops its oldest turns (never the system prompt):
the window starts `trimmed` messages into the history, and the next turn continues from the same
window, token-exact again."""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("pagedchat.conversation")


@dataclass
class Prompt:
    token_ids: list[int]
    reused: int  # tokens taken as they were from the previous turn
    fallback: str | None = None  # why the whole conversation was rendered again, if it was
    trimmed: int = 0  # history messages left out (oldest first) to fit the context


def chat_messages(system_prompt: str, history: list[dict]) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": m["role"], "content": m["content"]} for m in history]


def build_prompt(tokenizer, system_prompt: str, history: list[dict], new_text: str, model: str,
                 limit: int | None = None) -> Prompt:
    """history: stored messages (role, content, token_ids, model, trimmed_turns), oldest first. The
    last user message's token_ids are that turn's whole prompt; an assistant message's, its reply.
    `limit`: the most tokens the prompt may take; past it, older turns are dropped, two messages at a
    time (a prompt that cannot fit even then is returned as it is, for the caller to refuse)."""
    skip = _previous_window(history)
    prompt = _render(tokenizer, system_prompt, history, skip, new_text, model)
    if limit is not None and len(prompt.token_ids) > limit:
        # Trim to three quarters of the limit, so the next turns fit the same window token-exact.
        while len(prompt.token_ids) > limit * 3 // 4 and skip + 2 <= len(history):
            skip += 2
            prompt = _fallback(tokenizer, system_prompt, history[skip:], new_text,
                               f"{skip} oldest messages left out to fit {limit} tokens")
    prompt.trimmed = skip
    return prompt


def _render(tokenizer, system_prompt: str, history: list[dict], skip: int, new_text: str, model: str) -> Prompt:
    window = history[skip:]
    previous = _previous_context(history)
    if previous is None:
        return _fallback(tokenizer, system_prompt, window, new_text, None)
    context_ids, context_model = previous
    if context_model != model:
        return _fallback(tokenizer, system_prompt, window, new_text,
                         f"model changed from {context_model!r} to {model!r}")
    full_text = _template(tokenizer, system_prompt, window, new_text)
    context_text = tokenizer.decode(context_ids, skip_special_tokens=False)
    if not full_text.startswith(context_text):
        at = next((i for i, (a, b) in enumerate(zip(full_text, context_text)) if a != b),
                  min(len(full_text), len(context_text)))
        return _fallback(tokenizer, system_prompt, window, new_text,
                         f"stored tokens diverge from the template at character {at}: "
                         f"{context_text[at:at + 30]!r} vs {full_text[at:at + 30]!r}")
    suffix = tokenizer.encode(full_text[len(context_text):], add_special_tokens=False)
    return Prompt(context_ids + suffix, len(context_ids))


def _template(tokenizer, system_prompt: str, window: list[dict], new_text: str) -> str:
    messages = chat_messages(system_prompt, window) + [{"role": "user", "content": new_text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _previous_window(history: list[dict]) -> int:
    """Where the last turn's prompt started in the history (0 unless it was trimmed)."""
    if len(history) >= 2 and history[-2]["role"] == "user":
        return min(history[-2].get("trimmed_turns") or 0, len(history))
    return 0


def _previous_context(history: list[dict]) -> tuple[list[int], str] | None:
    if len(history) < 2 or history[-1]["role"] != "assistant" or history[-2]["role"] != "user":
        return None
    user, reply = history[-2], history[-1]
    if not user["token_ids"] or not reply["token_ids"]:
        return None
    return user["token_ids"] + reply["token_ids"], reply.get("model") or ""


def _fallback(tokenizer, system_prompt: str, window: list[dict], new_text: str, why: str | None) -> Prompt:
    if why:
        log.info("full re-render of the conversation: %s", why)
    return Prompt(tokenizer.encode(_template(tokenizer, system_prompt, window, new_text),
                                   add_special_tokens=False), 0, why)
