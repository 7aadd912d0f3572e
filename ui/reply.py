"""The assistant's reply as it grows, stored: at its first token, then at most every SAVE_EVERY_S
seconds, then complete; each write in a worker thread (the database never holds the event loop)."""
from __future__ import annotations

import asyncio
import time


class ReplyWriter:
    """The assistant message as it grows: stored at its first token, rewritten at most every
    SAVE_EVERY_S seconds while streaming ("streaming"), completed at the end. After a crash the
    app marks what was left "streaming" as interrupted."""
    SAVE_EVERY_S = 1.0

    def __init__(self, store, user: str, session_id: str, prompt_ids: list[int], model: str) -> None:
        self.store, self.user, self.session_id, self.prompt_ids, self.model = store, user, session_id, prompt_ids, model
        self.message_id: int | None = None
        self.last = None  # the latest RequestOutput
        self.content: str | None = None  # the text to store, where it is not the output's (a call's step)
        self.prefix_ids: list[int] = []  # a tool step's tokens before this step's: its call and the result
        self.tool_calls: list[dict] = []
        self.sources: list[dict] = []  # the knowledge chunks the prompt carried
        self._step_before = None
        self._saved_at = 0.0

    async def save(self, out, reason: str, content: str | None = None) -> None:
        self.last, self.content = out, content
        if self.message_id is None or time.monotonic() - self._saved_at >= self.SAVE_EVERY_S:
            await asyncio.to_thread(self._write, reason)

    def next_step(self, prompt_ids: list[int], tool_calls: list[dict]) -> None:
        """After a call: the reply goes on from `prompt_ids` (the turn's prompt, the call, its result);
        the stored token ids stay everything after the turn's own prompt."""
        self.prefix_ids += prompt_ids[len(self.prompt_ids):]
        self.prompt_ids, self.tool_calls, self.content = prompt_ids, tool_calls, ""
        self._step_before = self.last  # until this step's first token, the last output is the call's

    async def finish(self, reason: str | None) -> None:
        if self.last is not None:
            await asyncio.to_thread(self._write, reason)

    def _write(self, reason: str | None) -> None:
        out = self.last
        completion, m = out.outputs[0], out.metrics
        end = m.finished_time if m and m.finished_time else time.time()
        first = m.first_token_time if m else None
        n = len(completion.token_ids)
        fields = dict(model=self.model, finish_reason=reason, prompt_tokens=len(self.prompt_ids),
                      cached_tokens=out.num_cached_tokens, generated_tokens=n,
                      ttft=m.time_to_first_token if m else None,
                      tokens_per_s=(n - 1) / (end - first) if first and n > 1 and end > first else None)
        text = completion.text if self.content is None else self.content
        step_ids = [] if out is self._step_before else completion.token_ids
        ids, fields["tool_calls"], fields["sources"] = self.prefix_ids + step_ids, self.tool_calls, self.sources
        if self.message_id is None:
            self.message_id = self.store.add_message(self.user, self.session_id, "assistant", text, ids, **fields)
        else:
            self.store.update_message(self.user, self.session_id, self.message_id, text, ids, **fields)
        self._saved_at = time.monotonic()
