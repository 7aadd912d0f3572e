"""The customer chat, served at /chat/<assistant>: the sessions sidebar and the chat pane of
layout.py in the customer's language, the "talk to a person" button and its status line."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from engine.client import EngineClient
from engine.fleet import ModelFleet
from server.auth import VisitorCookie
from server.customers import CustomerTokens
from server.limits import UserLimiter
from ui.handlers import ChatHandlers
from ui.i18n import SWITCH_JS, text
from ui.layout import PRIVATE, chat_pane, chats_sidebar, wire_sessions, wire_turns


def build_customer_ui(client: EngineClient, store, *, limiter: UserLimiter, visitors: VisitorCookie | None,
                      salt_by_user: bool = False, fleet: ModelFleet | None = None, staffed: bool = True,
                      customers: CustomerTokens | None = None, on_waiting=None) -> gr.Blocks:
    """The customer chat, served at /chat/<assistant>: the conversation and its buttons only. The
    assistant's prompt, sampling and model never reach this page, and none of its events takes them.
    Each chat is answered by the engine of its assistant's model (fleet; `client` is the main one).
    staffed: the deployment has agents or operators, so a customer may ask for a person."""
    chat = ChatHandlers(client, store, visitors, limiter, salt_by_user, demo=False, fleet=fleet, staffed=staffed,
                        customers=customers, on_waiting=on_waiting)
    with gr.Blocks(title="Chat", analytics_enabled=False) as page:
        state = SimpleNamespace(user=gr.State(None), session=gr.State(None), rated=gr.State(None))
        side = chats_sidebar(text)
        with gr.Row():
            header = SimpleNamespace(title=gr.Markdown(elem_id="assistant-name"),
                                     language_btn=gr.Button(text("language"), size="sm", scale=0, elem_id="language"),
                                     theme_btn=gr.Button(text("theme"), size="sm", scale=0, elem_id="theme-toggle"))
        pane = chat_pane(demo=False, t=text, staffed=staffed)
        header.language_btn.click(None, js=SWITCH_JS)
        page.load(chat.greeting, None, [pane.chatbot, header.title], concurrency_limit=None, **PRIVATE)
        started = wire_sessions(page, chat, state, side, pane, header)
        sent = wire_turns(page, chat, state, side, pane)
        wire_person(chat, state, side, pane, [started, *sent])
    return page


# ---- the panels: components only ------------------------------------------------------------


def wire_person(chat: ChatHandlers, state: SimpleNamespace, side: SimpleNamespace, pane: SimpleNamespace,
                after: list) -> None:
    """The customer chat's handoff: ask for a person, the status line, and the poll that shows an
    agent's replies in the open tab. `after`: the page's first load (a chat still waiting after a
    restart shows it) and the send events (a message may have asked for a person)."""
    who, status = [state.user, state.session], [pane.status, pane.poll, pane.person_btn, pane.back_btn]
    quiet = dict(show_progress="hidden")
    pane.person_btn.click(chat.ask_person, who, status, **quiet)
    pane.back_btn.click(chat.back_to_assistant, who, status, **quiet)
    for event in after:
        event.then(chat.person_status, who, status, **quiet, **PRIVATE)
    for trigger in (side.sessions.input, side.new_btn.click):
        trigger(chat.person_status, who, status, **quiet, **PRIVATE)
    pane.poll.tick(chat.poll, [*who, pane.seen], [pane.chatbot, *status, pane.seen], show_progress="hidden",
                   **PRIVATE)
