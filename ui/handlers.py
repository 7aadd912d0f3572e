"""What the chat page's events do: identity, sessions, chat turns (ui/turns.py), a person
(ui/person.py), feedback, files (ui/files.py). One ChatHandlers object holds the engine client and
the store; its methods are the Gradio event functions (wired in layout.py) and run as well against a
fake EngineClient in tests.

Two faces (`demo`): the customer chat (demo=False), where a chat talks to the assistant its page is
served for (/chat/<assistant>) with that assistant's prompt and sampling, neither of which is ever
returned to the browser or taken from it; and the demo page (demo=True), where each chat's system
prompt and the sampling sliders are the visitor's."""
from __future__ import annotations

import asyncio
from typing import Callable

import gradio as gr

from engine.client import EngineClient
from engine.fleet import ModelFleet
from server.auth import VISITOR_COOKIE, VisitorCookie
from server.customers import Customer, CustomerTokens, customer_in
from server.limits import UserLimiter
from storage.handoff import Handoff
from storage.knowledge import Knowledge
from ui import actions, assistants, grounding, links
from ui.assistants import CHAT_REPETITION_PENALTY
from ui.cards import hide_cards
from ui.chat import ChatService, chat_title, unnamed
from ui.display import customer_display, display, event_index, feedback_values
from ui.files import FileHandlers
from ui.i18n import say
from ui.person import PersonHandlers
from ui.turns import MODEL_WAIT_S, TurnHandlers

DEMO_HINT = "Ask the support assistant anything."


class ChatHandlers(TurnHandlers, PersonHandlers, FileHandlers):
    def __init__(self, client: EngineClient, store, visitors: VisitorCookie | None = None,
                 limiter: UserLimiter | None = None, salt_by_user: bool = False, demo: bool = True,
                 fleet: ModelFleet | None = None, staffed: bool = True, customers: CustomerTokens | None = None,
                 on_waiting: Callable[[str], None] | None = None) -> None:
        """visitors: checks the signed visitor cookie (None when everyone logs in). customers: checks
        the cookie of a customer the shop signed in (server/customers.py; None without). demo: the demo
        page's handlers (a chat's own system prompt and sliders) rather than the customer chat's.
        fleet: the engines by model (an assistant may name its own); `client` is its main one.
        staffed: the deployment has agents or operators, so a customer may ask for a person.
        on_waiting(session_id): a chat began to wait for a person (ui/notify.py tells the team)."""
        self.client = client
        self.fleet = fleet or ModelFleet(client, {"": None})
        self.store = store
        self.visitors, self.customers = visitors, customers
        self.signed_in: set[Customer] = set()  # customers whose row says what their shop last said
        self.demo, self.staffed = demo, staffed
        self.display = display if demo else customer_display
        self.handoff = Handoff(store, on_waiting)
        self.knowledge = Knowledge(store)
        self.hosts: dict[tuple, frozenset[str]] = {}  # (assistant, version, its documents' stamp) -> hosts_of
        self.service = ChatService(client, store, limiter, salt_by_user, self.display, self.tools_of, self.handoff.ask,
                                   self.chunks_for, self.hosts_of)
        assistants.ensure_default(store)

    def version_of(self, session: dict) -> dict | None:
        """The assistant version a chat started with."""
        return self.store.assistant(session.get("assistant") or assistants.DEFAULT_SLUG, session.get("assistant_version"))

    def tools_of(self, session: dict) -> list:
        """The chat's tools; handoff only where someone could answer."""
        a = self.version_of(session)
        return [t for t in actions.chat_tools(a["tools"]) if self.staffed or t.name != "handoff"] if a else []

    def chunks_for(self, session: dict, history: list[dict], text: str) -> list:
        """The knowledge chunks of a chat's assistant for this turn (ui/grounding.py)."""
        a = self.version_of(session)
        return grounding.retrieve(self.knowledge, a, history, text) if a else []

    def hosts_of(self, session: dict | None) -> frozenset[str] | None:
        """The sites the customer chat links to (ui/links.py); None on the demo page (replies as written)."""
        if self.demo:
            return None
        a = self.version_of(session) if session else None
        if a is None:
            return frozenset()
        key = (a["assistant"], a["version"], self.knowledge.stamp(a["assistant"]))
        if key not in self.hosts:  # a scan of the documents: 8 ms over 3000 chunks (Zen 5), once per change
            if len(self.hosts) >= 256:
                self.hosts.clear()
            self.hosts[key] = links.assistant_hosts(a, self.knowledge.texts_with_addresses(a["assistant"]))
        return self.hosts[key]

    def shown(self, uid: str, sid: str) -> list[dict]:
        """A chat's stored messages as its chatbot shows them (it reads the database: worker threads)."""
        return self.display(self.store.messages(uid, sid), self.hosts_of(self.store.session(uid, sid)))

    # ---- identity -----------------------------------------------------------------------
    def who(self, known: str | None, request: gr.Request) -> str:
        """The login name if there is a login, else the customer the shop signed in, else the visitor
        id in the server-signed cookie; a client without any is known by its connection only."""
        name = getattr(request, "username", None)
        if name:
            return f"login:{name}"
        cookies = getattr(request, "cookies", None) or {}
        customer = customer_in(cookies, self.customers)
        if customer is not None:
            uid = f"customer:{customer.id}"
            if customer not in self.signed_in:
                self.store.ensure_user(uid, customer.name or None, customer.email)
                if len(self.signed_in) >= 10_000:
                    self.signed_in.clear()
                self.signed_in.add(customer)
            return uid
        visitor = self.visitors.visitor(cookies.get(VISITOR_COOKIE)) if self.visitors else None
        if visitor:
            return f"visitor:{visitor}"
        return known or f"tab:{request.session_hash}"

    def assistant_slug(self, request: gr.Request | None) -> str | None:
        """The assistant this page serves (/chat/<assistant>), None on the demo page."""
        http = getattr(request, "request", None)
        return (getattr(http, "path_params", None) or {}).get("assistant") or getattr(request, "assistant", None)

    def assistant(self, request: gr.Request | None) -> dict:
        """The latest version of this page's assistant (the default one on the demo page)."""
        found = self.store.assistant(self.assistant_slug(request) or assistants.DEFAULT_SLUG)
        if found is None:
            raise gr.Error(say(request, "no_assistant", address=f"/chat/{self.assistant_slug(request)}"))
        return found

    def engine_for(self, assistant: dict | None) -> EngineClient:
        """The engine that answers an assistant's chats: its own model's, where it names one the
        deployment offers (the customer chat); the main engine on the demo page."""
        return self.client if self.demo or assistant is None else self.fleet.client_for(assistant["model"])

    def _owned_here(self, uid: str, sid: str | None, request: gr.Request) -> bool:
        """Whether `sid` is this user's and belongs on this page (its assistant's, in the customer chat)."""
        session = self.store.session(uid, sid) if sid else None
        return session is not None and (self.demo or session["assistant"] == self.assistant_slug(request))

    def current(self, uid: str | None, sid: str | None, request: gr.Request) -> tuple[str, str]:
        """The user and a session of theirs: the given one if it is theirs (and, in the customer chat,
        this assistant's), else their newest there (or a new one)."""
        uid = self.who(uid, request)
        if not self._owned_here(uid, sid, request):
            existing = self.store.sessions(uid, assistant=None if self.demo else self.assistant_slug(request))
            sid = existing[0]["id"] if existing else self._new_session(uid, request)
        return uid, sid

    def _new_session(self, uid: str, request: gr.Request, system_prompt: str | None = None) -> str:
        """A chat with this page's assistant at its latest version; on the demo page `system_prompt`
        (the visitor's) replaces the assistant's."""
        a = self.assistant(request)
        info = self.engine_for(a).info
        model = info.name if info else ""
        prompt = system_prompt if self.demo and system_prompt else a["system_prompt"]
        return self.store.create_session(uid, system_prompt=prompt, model=model, assistant=a["assistant"],
                                         assistant_version=a["version"])

    def session_choices(self, uid: str, request: gr.Request | None = None, query: str = "") -> list[tuple[str, str]]:
        here = None if self.demo else self.assistant_slug(request)
        default = "New chat" if self.demo else say(request, "new_chat")  # stored as "New chat" until named
        return [({"New chat": default}.get(s["title"], s["title"]) or "Untitled", s["id"])
                for s in self.store.sessions(uid, query, assistant=here)]

    def _system(self, session: dict) -> tuple:
        """The system prompt as a page output: the demo page shows it; the customer chat has no such output."""
        return (session["system_prompt"],) if self.demo else ()

    # ---- sessions -----------------------------------------------------------------------
    def init(self, request: gr.Request):
        """On load: (user, sessions, session, chatbot, [system prompt,] title)."""
        uid, sid = self.current(None, None, request)
        return (uid, *self.show_session(uid, sid, request))

    async def greeting(self, request: gr.Request):
        """On load: the chatbot's placeholder says the model is loading until it is ready (a message
        typed meanwhile is answered then), then the assistant's greeting and quick replies (the
        customer chat, with the assistant's name as the page's heading) or the demo's hint."""
        a = await asyncio.to_thread(self.assistant, request)
        chips = [{"text": q} for q in a["quick_replies"]] or None
        ready = (gr.update(placeholder=DEMO_HINT) if self.demo
                 else gr.update(placeholder=a["greeting"] or None, examples=chips))
        outputs = (lambda chat: chat) if self.demo else (lambda chat: (chat, f"# {a['name']}"))
        client = self.engine_for(a)
        if client.state == "loading":
            yield outputs(gr.update(placeholder=say(request, "loading")))
            await asyncio.to_thread(client.wait_ready, MODEL_WAIT_S)
        yield outputs(ready)

    def stage_quick_reply(self, history, data: gr.SelectData):
        """A quick-reply chip: its fixed text shows at once and is sent as the customer's message."""
        value = data.value if isinstance(data.value, dict) else {"text": str(data.value or "")}
        return self.stage(value.get("text", ""), history)

    def open_session(self, uid, sid, request: gr.Request):
        uid = self.who(uid, request)
        if not self._owned_here(uid, sid, request):
            return (gr.update(),) * (4 if self.demo else 3)
        s = self.store.session(uid, sid)
        return (sid, self.shown(uid, sid), *self._system(s), s["title"])

    def new_chat(self, uid, system_text=None, request: gr.Request = None):
        uid = self.who(uid, request)
        sid = self._new_session(uid, request, system_text)
        return gr.update(choices=self.session_choices(uid, request), value=sid), sid, [], "New chat"

    def rename(self, uid, sid, text, request: gr.Request):
        uid, sid = self.current(uid, sid, request)
        self.store.update_session(uid, sid, title=(text or "Untitled")[:80])
        return gr.update(choices=self.session_choices(uid, request), value=sid)

    def delete(self, uid, sid, request: gr.Request):
        """After the user confirmed: this chat goes; they see their newest other one (or a new one)."""
        uid, sid = self.current(uid, sid, request)
        self.store.delete_session(uid, sid)
        return (*self.show_session(*self.current(uid, None, request), request), gr.update(visible=False))

    def marks(self, uid, sid, request: gr.Request):
        """The chatbot's thumbs as stored (chained after every event that shows messages, so API
        clients of those events get plain message lists)."""
        uid, sid = self.current(uid, sid, request)
        return gr.update(feedback_value=feedback_values(self.store.messages(uid, sid)))

    def show_session(self, uid: str, sid: str, request: gr.Request | None = None) -> tuple:
        """(sessions list, session, chatbot, [system prompt,] title) showing one of the user's sessions."""
        s = self.store.session(uid, sid)
        return (gr.update(choices=self.session_choices(uid, request), value=sid), sid,
                self.shown(uid, sid), *self._system(s), s["title"])

    def find(self, uid, query, request: gr.Request):
        return gr.update(choices=self.session_choices(self.who(uid, request), request, query))

    def save_system(self, uid, sid, text, request: gr.Request):
        if not self.demo:
            raise gr.Error(say(request, "set_by_shop"))
        uid, sid = self.current(uid, sid, request)
        self.store.update_session(uid, sid, system_prompt=text)
        gr.Info("System prompt saved for this chat.")

    def name_at_once(self, uid, sid, text, request: gr.Request):
        """As a new chat's first message shows (after `stage`, beside `send`): the list and the title box
        name the chat after it (chat_title, as the turn stores it) instead of after the reply. Nothing is
        stored here; `refresh`, after the turn, shows what was (a refused message leaves "New chat")."""
        uid, text = self.who(uid, request), (text or "").strip()
        if not text or not self._owned_here(uid, sid, request):
            return gr.update(), gr.update()
        if not unnamed(self.store.session(uid, sid), self.store.messages(uid, sid)):
            return gr.update(), gr.update()
        title = chat_title(hide_cards(text)[0])
        choices = [(title if s == sid else label, s) for label, s in self.session_choices(uid, request)]
        return gr.update(choices=choices, value=sid), title

    def refresh(self, uid, sid, request: gr.Request):
        """After a turn: the sessions list and title (the first message names a new chat)."""
        uid, sid = self.current(uid, sid, request)
        return (gr.update(choices=self.session_choices(uid, request), value=sid), sid,
                self.store.session(uid, sid)["title"])

    def delete_all(self, uid, request: gr.Request):
        """After the user confirmed: every chat of theirs goes; they get a fresh one."""
        uid = self.who(uid, request)
        gone = self.store.delete_all_sessions(uid)
        gr.Info(say(request, "deleted", n=gone))
        return (*self.show_session(*self.current(uid, None, request), request), gr.update(visible=False))

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

    # ---- feedback -----------------------------------------------------------------------
    def rate(self, uid, sid, data: gr.LikeData, request: gr.Request):
        """Thumbs up/down on a reply; opens the comment box for it."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        index = event_index(data)
        if index is None or not 0 <= index < len(messages) or messages[index]["role"] != "assistant":
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
                gr.Info(say(request, "thanks"))
        return "", gr.update(visible=False)
