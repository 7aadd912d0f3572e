"""Token-exact continuation: a turn's prompt is the token ids the engine saw last turn (prompt +
reply) followed by only the new turn, rendered by the chat template. The whole history is then a
prefix the engine has cached, token for token.

A conversation that outgrows the model's context drops its oldest turns (never the system prompt):
the window starts `trimmed` messages into the history, and the next turn continues from the same
window, token-exact again."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.tools import ToolPlan, template_inputs, template_knows_tools

log = logging.getLogger("pagedchat.conversation")


@dataclass
class Prompt:
    token_ids: list[int]
    reused: int  # tokens taken as they were from the previous turn
    fallback: str | None = None  # why the whole conversation was rendered again, if it was
    trimmed: int = 0  # history messages left out (oldest first) to fit the context


def chat_messages(system_prompt: str, history: list[dict]) -> list[dict]:
    """Stored messages -> the template's. A reply that used tools is what the model saw: its call
    (the text it wrote), each result as a tool message, then the answer."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for m in history:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            msgs.append(call_message(calls))
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": c["result"]} for c in calls]
        msgs.append({"role": m["role"], "content": m["content"]})
    return msgs


def call_message(calls: list[dict]) -> dict:
    """The assistant's turn that made these calls (the chat's records: id, name, arguments, text)."""
    return {"role": "assistant", "content": "", "call_text": calls[0].get("text"),
            "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                           for c in calls]}


def template_text(tokenizer, messages: list[dict], plan: ToolPlan | None = None) -> str:
    msgs, extra = template_inputs(messages, plan, template_knows_tools(tokenizer))
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **extra)


def extend(tokenizer, context_ids: list[int], full_text: str, encode=None) -> Prompt:
    """`context_ids` (what the engine saw) followed by the rest of `full_text`, if the context is its
    prefix, token for token; else the whole text encoded again by `encode` (Prompt.fallback says why)."""
    context_text = tokenizer.decode(context_ids, skip_special_tokens=False)
    if not full_text.startswith(context_text):
        at = next((i for i, (a, b) in enumerate(zip(full_text, context_text)) if a != b),
                  min(len(full_text), len(context_text)))
        why = (f"stored tokens diverge from the template at character {at}: "
               f"{context_text[at:at + 30]!r} vs {full_text[at:at + 30]!r}")
        log.info("full re-render of the conversation: %s", why)
        return Prompt(_encoder(tokenizer, encode)(full_text), 0, why)
    suffix = tokenizer.encode(full_text[len(context_text):], add_special_tokens=False)
    return Prompt(context_ids + suffix, len(context_ids))


def _encoder(tokenizer, encode):
    return encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))


def build_prompt(tokenizer, system_prompt: str, history: list[dict], new_text: str, model: str,
                 limit: int | None = None, plan: ToolPlan | None = None, encode=None) -> Prompt:
    """history: stored messages (role, content, token_ids, model, trimmed_turns), oldest first. The
    last user message's token_ids are that turn's whole prompt; an assistant message's, its reply.
    `limit`: the most tokens the prompt may take; past it, older turns are dropped, two messages at a
    time (a prompt that cannot fit even then is returned as it is, for the caller to refuse).
    `encode(text) -> ids`: how a whole prompt is tokenized (ui/grounding.py splices knowledge in)."""
    skip = _previous_window(history)
    encode = _encoder(tokenizer, encode)
    prompt = _render(tokenizer, system_prompt, history, skip, new_text, model, plan, encode)
    if limit is not None and len(prompt.token_ids) > limit:
        # Trim to three quarters of the limit, so the next turns fit the same window token-exact.
        while len(prompt.token_ids) > limit * 3 // 4 and skip + 2 <= len(history):
            skip += 2
            prompt = _fallback(tokenizer, system_prompt, history[skip:], new_text,
                               f"{skip} oldest messages left out to fit {limit} tokens", plan, encode)
    prompt.trimmed = skip
    return prompt


def _render(tokenizer, system_prompt: str, history: list[dict], skip: int, new_text: str, model: str,
            plan: ToolPlan | None, encode) -> Prompt:
    window = history[skip:]
    previous = _previous_context(history)
    if previous is None:
        return _fallback(tokenizer, system_prompt, window, new_text, None, plan, encode)
    context_ids, context_model = previous
    if context_model != model:
        return _fallback(tokenizer, system_prompt, window, new_text,
                         f"model changed from {context_model!r} to {model!r}", plan, encode)
    window = _cut_reply_as_generated(tokenizer, window)
    return extend(tokenizer, context_ids, _template(tokenizer, system_prompt, window, new_text, plan), encode)


def _cut_reply_as_generated(tokenizer, window: list[dict]) -> list[dict]:
    """A reply cut by a crash was stored mid-stream, when its text may lag its tokens (the detokenizer
    holds back an unfinished character or stop string): the window with that reply's text as its tokens
    decode to, so the next turn still continues token-exact; the window as it is otherwise."""
    reply = window[-1]
    if reply.get("finish_reason") != "interrupted":
        return window
    text = tokenizer.decode(reply["token_ids"], skip_special_tokens=True)
    if not text.startswith(reply["content"]):
        return window
    return window[:-1] + [dict(reply, content=text)]


def _template(tokenizer, system_prompt: str, window: list[dict], new_text: str, plan: ToolPlan | None) -> str:
    return template_text(tokenizer, chat_messages(system_prompt, window) + [{"role": "user", "content": new_text}],
                         plan)


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


def _fallback(tokenizer, system_prompt: str, window: list[dict], new_text: str, why: str | None,
              plan: ToolPlan | None, encode) -> Prompt:
    if why:
        log.info("full re-render of the conversation: %s", why)
    return Prompt(encode(_template(tokenizer, system_prompt, window, new_text, plan)), 0, why)
