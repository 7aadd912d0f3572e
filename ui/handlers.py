"""What the chat page's events do: identity, sessions, chat turns. One ChatHandlers object holds
the engine client and the store; its methods are the Gradio event functions (wired in layout.py)
and run as well against a fake EngineClient in tests."""
from __future__ import annotations

import contextlib
import uuid

import gradio as gr

from engine.client import EngineClient, EngineDeadError, EngineOverloadedError
from engine.sampling_params import SamplingParams
from ui.chat import ChatService, display
from ui.simulate import CUSTOMER_SERVICE_PROMPT

REFUSALS = (ValueError, EngineDeadError, EngineOverloadedError)  # shown to the user as a warning


class ChatHandlers:
    def __init__(self, client: EngineClient, store) -> None:
        self.client = client
        self.store = store
        self.service = ChatService(client, store)

    # ---- identity -----------------------------------------------------------------------
    @staticmethod
    def who(known: str | None, request: gr.Request) -> str:
        """Logged-in name if there is a login, else the browser's id (or, for API clients that never
        ran the page's load event, their connection)."""
        name = getattr(request, "username", None)
        if name:
            return f"login:{name}"
        return known or f"tab:{request.session_hash}"

    def current(self, uid: str | None, sid: str | None, request: gr.Request) -> tuple[str, str]:
        """The user and a session of theirs: the given one if it is theirs, else their newest (or a new one)."""
        uid = self.who(uid, request)
        if not sid or self.store.session(uid, sid) is None:
            existing = self.store.sessions(uid)
            sid = existing[0]["id"] if existing else self._new_session(uid, CUSTOMER_SERVICE_PROMPT)
        return uid, sid

    def _new_session(self, uid: str, system_prompt: str) -> str:
        model = self.client.info.name if self.client.info else ""
        return self.store.create_session(uid, system_prompt=system_prompt, model=model)

    def session_choices(self, uid: str, query: str = "") -> list[tuple[str, str]]:
        return [(s["title"] or "Untitled", s["id"]) for s in self.store.sessions(uid, query)]

    # ---- sessions -----------------------------------------------------------------------
    def init(self, browser_value, request: gr.Request):
        browser_value = browser_value or uuid.uuid4().hex
        uid, sid = self.current(browser_value, None, request)
        s = self.store.session(uid, sid)
        return (browser_value, uid, gr.update(choices=self.session_choices(uid), value=sid), sid,
                display(self.store.messages(uid, sid)), s["system_prompt"], s["title"])

    def open_session(self, uid, sid, request: gr.Request):
        uid = self.who(uid, request)
        s = self.store.session(uid, sid) if sid else None
        if s is None:
            return gr.update(), gr.update(), gr.update(), gr.update()
        return sid, display(self.store.messages(uid, sid)), s["system_prompt"], s["title"]

    def new_chat(self, uid, system_text, request: gr.Request):
        uid = self.who(uid, request)
        sid = self._new_session(uid, system_text or CUSTOMER_SERVICE_PROMPT)
        return gr.update(choices=self.session_choices(uid), value=sid), sid, [], "New chat"

    def rename(self, uid, sid, text, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        self.store.update_session(uid, sid, title=(text or "Untitled")[:80])
        return gr.update(choices=self.session_choices(uid), value=sid)

    def delete(self, uid, sid, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        self.store.delete_session(uid, sid)
        uid, sid = self.current(uid, None, request)
        s = self.store.session(uid, sid)
        return (gr.update(choices=self.session_choices(uid), value=sid), sid, display(self.store.messages(uid, sid)),
                s["system_prompt"], s["title"])

    def find(self, uid, query, request: gr.Request):
        return gr.update(choices=self.session_choices(self.who(uid, request), query))

    def save_system(self, uid, sid, text, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        self.store.update_session(uid, sid, system_prompt=text)
        gr.Info("System prompt saved for this chat.")

    def refresh(self, uid, sid, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        return gr.update(choices=self.session_choices(uid), value=sid), sid

    # ---- chat turns ---------------------------------------------------------------------
    async def send(self, uid, sid, text, temp, p, max_new, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        raw, text = text, (text or "").strip()
        if not text:
            yield gr.update(), gr.update()
            return
        try:
            params = SamplingParams(temperature=temp, top_p=p, max_tokens=int(max_new))
            turn = self.service.turn(uid, sid, text, params, request.session_hash)
            async with contextlib.aclosing(turn):
                async for shown, _ in turn:
                    yield shown, ""
        except REFUSALS as e:
            gr.Warning(str(e))
            yield display(self.store.messages(uid, sid)), raw  # the message stays in the box, as typed

    async def regenerate(self, uid, sid, temp, p, max_new, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        history = self.store.messages(uid, sid)
        if history and history[-1]["role"] == "assistant":
            self.store.delete_messages_from(uid, sid, history[-1]["id"])
        try:
            params = SamplingParams(temperature=temp, top_p=p, max_tokens=int(max_new))
            turn = self.service.turn(uid, sid, "", params, request.session_hash, regenerate=True)
            async with contextlib.aclosing(turn):
                async for shown, _ in turn:
                    yield shown
        except REFUSALS as e:
            gr.Warning(str(e))
            yield display(self.store.messages(uid, sid))

    def edit_last(self, uid, sid, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        users = [m for m in self.store.messages(uid, sid) if m["role"] == "user"]
        if not users:
            return gr.update(), gr.update()
        self.store.delete_messages_from(uid, sid, users[-1]["id"])
        return display(self.store.messages(uid, sid)), users[-1]["content"]

    def tab_closed(self, request: gr.Request) -> None:
        self.service.abort_tab(request.session_hash)
