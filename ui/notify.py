"""Telling the team a customer waits (`--handoff-webhook-file`): when a chat goes in line for a person
(the button, the words, the assistant's handoff tool), pagedchat POSTs a JSON message to the URL in
that file, which Slack's and Mattermost's incoming webhooks (`text`) and Discord's (`content`) take
as they are, with the details for anything else. Agents need not keep the console open to notice.
Posts go from one background thread, 5 s each at most; a failure is logged and the chat waits as
before. The message carries the customer's last words (card numbers are already masked, ui/cards.py)."""
from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.request

TIMEOUT_S = 5.0
MAX_QUEUED = 100
MAX_QUOTE_CHARS = 200
log = logging.getLogger("pagedchat.notify")


def read_webhook(path: str) -> str:
    """The webhook's URL from its file (it holds a secret: never on the command line)."""
    with open(path, encoding="utf-8") as f:
        url = f.read().strip()
    if not url.startswith(("https://", "http://")):
        raise ValueError(f"--handoff-webhook-file: {path} must hold an http(s) URL")
    return url


class HandoffWebhook:
    def __init__(self, url: str, store) -> None:
        self.url, self.store = url, store
        self.queue: queue.Queue[str] = queue.Queue(MAX_QUEUED)
        self.sent = self.failed = 0
        threading.Thread(target=self._run, name="handoff-webhook", daemon=True).start()

    def __call__(self, session_id: str) -> None:
        """A chat began to wait (storage.handoff.Handoff.ask): its message goes out in the background."""
        try:
            self.queue.put_nowait(session_id)
        except queue.Full:
            log.warning("handoff webhook: %d messages already queued; chat %s not announced", MAX_QUEUED, session_id)

    def message(self, session_id: str) -> dict:
        with self.store._db() as db:
            row = db.execute(
                "select s.assistant, s.user_id, u.name, u.email, (select count(*) from sessions where state = "
                "'waiting'), (select content from messages m where m.session_id = s.id and m.role = 'user' "
                "order by m.id desc limit 1) from sessions s left join users u on u.id = s.user_id where s.id = ?",
                [session_id]).fetchone()
        assistant, user, name, email, waiting, last = row or ("", "", "", "", 0, "")
        who = f"{name} <{email}>" if email else user
        quote = (last or "").replace("\n", " ")[:MAX_QUOTE_CHARS]
        text = (f"A customer is waiting for a person (chat {session_id}, {assistant or 'support'}, {who}): "
                f"\"{quote}\". {waiting} waiting now; answer them in the console's inbox.")
        return {"text": text, "content": text, "chat": session_id, "assistant": assistant, "customer": who,
                "waiting": waiting, "message": quote}

    def _run(self) -> None:
        while True:
            session_id = self.queue.get()
            try:
                body = json.dumps(self.message(session_id)).encode()
                request = urllib.request.Request(self.url, data=body, method="POST", headers={
                    "Content-Type": "application/json", "User-Agent": "pagedchat-handoff"})
                with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                    response.read(4096)
                self.sent += 1
            except Exception as e:  # noqa: BLE001 - a failed post is logged; the chat still waits
                self.failed += 1
                log.warning("handoff webhook: could not announce chat %s: %s", session_id, e)
            finally:
                self.queue.task_done()
