"""What the chat page's events do: identity, sessions, chat turns. One ChatHandlers object holds
the engine client and the store; its methods are the Gradio event functions (wired in layout.py)
and run as well against a fake EngineClient in tests."""
from __future__ import annotations

import contextlib

import gradio as gr

from engine.client import EngineClient, EngineDeadError, EngineOverloadedError
from server.auth import VISITOR_COOKIE, VisitorCookie
from server.limits import TooManyRequestsError, UserLimiter
from ui import transfer
from ui.chat import TYPING, ChatService, ReplyCut, display, feedback_values, plain_text
from ui.simulate import CUSTOMER_SERVICE_PROMPT

REFUSALS = (ValueError, EngineDeadError, EngineOverloadedError, TooManyRequestsError)  # shown as a warning
# The chat's own sampling default beside the model's: with SmolLM2's card values alone (temperature
# 0.2, top-p 0.9) 5 of 6 second replies looped, a sentence repeated 12-36 times; with 1.1, none did.
CHAT_REPETITION_PENALTY = 1.1
class ChatHandlers:
    def __init__(self, client: EngineClient, store, visitors: VisitorCookie | None = None,
                 limiter: UserLimiter | None = None, salt_by_user: bool = False) -> None:
        """visitors: checks the signed visitor cookie (None when everyone logs in)."""
        self.client = client
        self.store = store
        self.visitors = visitors
        self.service = ChatService(client, store, limiter, salt_by_user)

    # ---- identity -----------------------------------------------------------------------
    def who(self, known: str | None, request: gr.Request) -> str:
        """The login name if there is a login, else the visitor id in the server-signed cookie; a
        client without either is known by its connection only."""
        name = getattr(request, "username", None)
        if name:
            return f"login:{name}"
        cookies = getattr(request, "cookies", None) or {}
        visitor = self.visitors.visitor(cookies.get(VISITOR_COOKIE)) if self.visitors else None
        if visitor:
            return f"visitor:{visitor}"
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
    def init(self, request: gr.Request):
        uid, sid = self.current(None, None, request)
        s = self.store.session(uid, sid)
        return (uid, gr.update(choices=self.session_choices(uid), value=sid), sid,
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
        return self.show_session(*self.current(uid, None, request))

    def marks(self, uid, sid, request: gr.Request):
        """The chatbot's thumbs as stored (chained after every event that shows messages, so API
        clients of those events get plain message lists)."""
        uid, sid = self.current(uid, sid, request)
        return gr.update(feedback_value=feedback_values(self.store.messages(uid, sid)))

    def show_session(self, uid: str, sid: str) -> tuple:
        """(sessions list, session, chatbot, system prompt, title) showing one of the user's sessions."""
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
        """After a turn: the sessions list and title (the first message names a new chat)."""
        uid, sid = self.current(uid, sid, request)
        return gr.update(choices=self.session_choices(uid), value=sid), sid, self.store.session(uid, sid)["title"]

    def delete_all(self, uid, request: gr.Request):
        """After the user confirmed: every chat of theirs goes; they get a fresh one."""
        uid = self.who(uid, request)
        gone = self.store.delete_all_sessions(uid)
        gr.Info(f"Deleted {gone} chat(s).")
        return (*self.show_session(*self.current(uid, None, request)), gr.update(visible=False))

    # ---- sampling -----------------------------------------------------------------------
    def sampling_defaults(self):
        """The model's sampling defaults for the sliders, and a line saying what is in force."""
        info = self.client.info
        if info is None:
            return gr.update(), gr.update(), gr.update(), "The model is loading; its sampling defaults apply once it is ready."
        d = info.sampling_defaults
        temperature, top_p = d.get("temperature", 1.0), d.get("top_p", 1.0)
        penalty = d.get("repetition_penalty", CHAT_REPETITION_PENALTY)
        where = "the chat's default" if "repetition_penalty" not in d else info.sampling_source
        note = (f"Defaults for **{info.name}**: temperature {temperature:g} and top-p {top_p:g} from "
                f"{info.sampling_source}; repetition penalty {penalty:g} from {where}.")
        return temperature, top_p, penalty, note

    # ---- chat turns ---------------------------------------------------------------------
    def _params(self, temperature, top_p, max_new, penalty):
        """The sliders' values over the model's own defaults; refused while no model is loaded."""
        info = self.client.info
        if info is None:
            raise EngineDeadError(self.client.error or "the model is still loading")
        return info.default_sampling(temperature=temperature, top_p=top_p, max_tokens=int(max_new),
                                     repetition_penalty=penalty)

    @staticmethod
    def stage(text, history):
        """Browser only, unqueued: the message shows at once and the box clears; `send` follows."""
        text = (text or "").strip()
        if not text:
            return gr.update(), gr.update(), ""
        return "", list(history or []) + [{"role": "user", "content": text}, TYPING], text

    async def send(self, uid, sid, text, temp, p, max_new, penalty=CHAT_REPETITION_PENALTY,
                   request: gr.Request = None):
        uid, sid = self.current(uid, sid, request)
        raw, text = text, (text or "").strip()
        if not text:
            yield gr.update(), gr.update()
            return
        try:
            turn = self.service.turn(uid, sid, text, self._params(temp, p, max_new, penalty), request.session_hash)
            async with contextlib.aclosing(turn):
                async for messages, _ in turn:
                    yield messages, ""
        except REFUSALS as e:
            gr.Warning(str(e))
            sent = isinstance(e, ReplyCut)  # else unsent: the message goes back into the box, as typed
            yield display(self.store.messages(uid, sid)), "" if sent else raw

    async def regenerate(self, uid, sid, temp, p, max_new, penalty=CHAT_REPETITION_PENALTY,
                         request: gr.Request = None):
        uid, sid = self.current(uid, sid, request)
        history = self.store.messages(uid, sid)
        if history and history[-1]["role"] == "assistant":
            self.store.delete_messages_from(uid, sid, history[-1]["id"])
        try:
            turn = self.service.turn(uid, sid, "", self._params(temp, p, max_new, penalty), request.session_hash,
                                     regenerate=True)
            async with contextlib.aclosing(turn):
                async for messages, _ in turn:
                    yield messages
        except REFUSALS as e:
            gr.Warning(str(e))
            yield display(self.store.messages(uid, sid))

    async def edit_from_here(self, uid, sid, temp, p, max_new, penalty, data: gr.EditData, request: gr.Request):
        """Edit and resend: the edited message and everything after it leave the chat (kept in the
        database as a branch); the edited text is sent as a new turn on the untouched history."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        index = data.index if isinstance(data.index, int) else data.index[0]
        if not 0 <= index < len(messages) or messages[index]["role"] != "user":
            gr.Warning("Only your own messages can be edited.")
            yield display(messages), gr.update()
            return
        self.store.branch_from(uid, sid, messages[index]["id"])
        async for update in self.send(uid, sid, plain_text(data.value), temp, p, max_new, penalty, request):
            yield update

    # ---- feedback -----------------------------------------------------------------------
    def rate(self, uid, sid, data: gr.LikeData, request: gr.Request):
        """Thumbs up/down on a reply; opens the comment box for it."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        index = data.index if isinstance(data.index, int) else data.index[0]
        if not 0 <= index < len(messages) or messages[index]["role"] != "assistant":
            return None, gr.update(visible=False)
        value = {True: 1, False: -1, "Like": 1, "Dislike": -1}.get(data.liked)
        self.store.set_feedback(uid, sid, messages[index]["id"], value)
        return messages[index]["id"], gr.update(visible=value is not None)

    def comment(self, uid, sid, message_id, text, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        if message_id is not None and (text or "").strip():
            rated = next((m for m in self.store.messages(uid, sid) if m["id"] == message_id), None)
            if rated is not None:
                self.store.set_feedback(uid, sid, message_id, rated["feedback"], text.strip()[:2000])
                gr.Info("Thanks for the feedback.")
        return "", gr.update(visible=False)

    # ---- export and import --------------------------------------------------------------
    def export(self, uid, sid, fmt: str, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        session, messages = self.store.session(uid, sid), self.store.messages(uid, sid)
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
            chat = transfer.read_chat(path)
        except (ValueError, OSError) as e:
            gr.Warning(f"Could not import that file: {e}")
            return gr.update(), gr.update(), gr.update(), gr.update(), gr.update()
        sid = self.store.import_session(uid, chat["title"], chat["system_prompt"], chat["messages"])
        gr.Info(f"Imported \"{chat['title']}\" as a new chat.")
        return self.show_session(uid, sid)

    def tab_closed(self, request: gr.Request) -> None:
        self.service.abort_tab(request.session_hash)
