"""A chat in and out as a file (ui/transfer.py writes and reads them). Mixed into ChatHandlers
(ui/handlers.py), whose current(), who(), assistant(), show_session(), store and demo it uses."""
from __future__ import annotations

import gradio as gr

from ui import transfer
from ui.cards import hide_cards
from ui.i18n import say


class FileHandlers:
    def export(self, uid, sid, fmt: str, request: gr.Request):
        """The chat as a file. From the customer chat without the assistant's instructions: neither the
        system prompt nor the token ids (a user message's ids hold the whole prompt, instructions too)."""
        uid, sid = self.current(uid, sid, request)
        session, messages = self.store.session(uid, sid), self.store.messages(uid, sid)
        if not self.demo:
            session = {**session, "system_prompt": ""}
            messages = [{**m, "token_ids": []} for m in messages]
        name = transfer.safe_name(session["title"])
        if fmt == "json":
            return transfer.write_file(f"{name}.json", transfer.chat_json(session, messages))
        return transfer.write_file(f"{name}.md", transfer.chat_markdown(session, messages))

    def export_markdown(self, uid, sid, request: gr.Request):
        return self.export(uid, sid, "md", request)

    def export_json(self, uid, sid, request: gr.Request):
        return self.export(uid, sid, "json", request)

    def import_chat(self, uid, upload, request: gr.Request):
        """A chat JSON file becomes a new session of this user's."""
        uid = self.who(uid, request)
        path = upload if isinstance(upload, str) else getattr(upload, "name", None) or getattr(upload, "path", None)
        try:
            if not isinstance(path, str):
                raise ValueError("no file was given")
            chat = transfer.read_chat(path)
        except (ValueError, OSError) as e:
            gr.Warning(say(request, "import_failed", why=e))
            return (gr.update(),) * (5 if self.demo else 4)
        messages = _without_cards(chat["messages"])
        if self.demo:
            prompt, where = chat["system_prompt"], {}
        else:  # a file cannot choose the instructions: no prompt, and no token ids that could carry one
            a = self.assistant(request)
            prompt, where = a["system_prompt"], {"assistant": a["assistant"], "assistant_version": a["version"]}
            messages = [{**m, "token_ids": []} for m in messages]
        sid = self.store.import_session(uid, chat["title"], prompt, messages, **where)
        gr.Info(say(request, "imported", title=chat["title"]))
        return self.show_session(uid, sid, request)


def _without_cards(messages: list[dict]) -> list[dict]:
    """Imported messages with their card numbers masked (ui/cards.py). Where there was one, no
    message keeps its token ids (a turn's ids hold the whole conversation before it): the next turn
    renders the chat from its text."""
    masked = [{**m, "content": hide_cards(m["content"])[0]} for m in messages]
    if all(m["content"] == old["content"] for m, old in zip(masked, messages)):
        return messages
    return [{**m, "token_ids": []} for m in masked]
