"""Log probabilities in OpenAI's two shapes, from the engine's Logprob entries (one dict per token:
the chosen token and the top N, each with its text)."""
from __future__ import annotations


def _top(entry: dict, n: int) -> list:
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:n] if n else []


def _item(token_id: int, lp) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": max(lp.logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict], top_n: int) -> dict:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for token, entry in zip(token_ids, entries):
        content.append({**_item(token, entry[token]),
                        "top_logprobs": [_item(t, lp) for t, lp in _top(entry, top_n)]})
    return {"content": content}


class CompletionLogprobs:
    """The completions shape ({tokens, token_logprobs, top_logprobs, text_offset}), chunk by chunk:
    text offsets run on across chunks, from the start of the returned text (with echo, the prompt)."""

    def __init__(self, top_n: int, decode) -> None:
        """decode(token_id) -> text: for the first prompt token, which has no entry (echo)."""
        self.top_n, self.offset, self.decode = top_n, 0, decode

    def __call__(self, token_ids: list[int], entries: list) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries):
            if entry is None:  # the first prompt token: nothing before it to predict it
                text, logprob, top = self.decode(token), None, None
            else:
                text, logprob = entry[token].decoded_token or "", max(entry[token].logprob, -9999.0)
                top = {lp.decoded_token or "": max(lp.logprob, -9999.0) for _, lp in _top(entry, self.top_n)}
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text or "")
        return out
