"""The handoff inbox in the console: chats waiting for a person, those with one, and those the
assistant answered lately. Agents (`--agent NAME`) and operators take a chat, see all of it, reply
(the customer's open tab shows the reply within a second) and hand it back to the assistant. A
reply that is exactly one of the assistant's canned shortcuts (`/refund`) is expanded in the box,
to edit and send."""
from __future__ import annotations

import time
from types import SimpleNamespace

import gradio as gr

from storage.handoff import Handoff
from ui.cards import hide_cards
from ui.display import display

INBOX_COLUMNS = ["chat", "state", "agent", "waiting", "assistant", "customer", "last message"]
INBOX_WIDTHS = ["130px", "170px", "90px", "80px", "100px", "200px", "auto"]  # short and empty columns stay legible
MAX_REPLY_CHARS = 4000
# the console tab's title counts the chats waiting for a person, so an agent working in another tab sees them
TITLE_JS = """(n) => { const base = document.title.replace(/^\\(\\d+\\) /, "");
    document.title = n > 0 ? `(${n}) ${base}` : base; }"""
STATE_WORDS = {"waiting": "waiting for a person", "agent": "with a person", "assistant": "with the assistant"}


class InboxHandlers:
    def __init__(self, store, agents: set[str]) -> None:
        """agents: the login names who may work the inbox (operators included)."""
        self.store, self.agents, self.handoff = store, agents, Handoff(store)
        self.said: dict[str, float] = {}  # agent -> when their presence was last written (monotonic)

    def is_agent(self, request: gr.Request | None) -> bool:
        return getattr(request, "username", None) in self.agents

    def _name(self, request: gr.Request) -> str:
        if not self.is_agent(request):
            raise gr.Error("Only agents and operators can work the inbox.")
        return request.username

    def rows(self, find: str | None, request: gr.Request):
        """(the table, the chat picker's choices, who of the team is online, how many chats wait) — nothing
        for anyone but an agent. The table is the inbox, or with words in `find` every chat that holds
        them (an order number, a customer's words, a chat id), newest first."""
        if not self.is_agent(request):
            return gr.update(), gr.update(), gr.update(), gr.update()
        self._here(request.username)
        find = (find or "").strip()
        listed = self.handoff.find(find) if find else self.handoff.inbox()
        now, rows = time.time(), []
        for r in listed:
            waiting = f"{(now - r['waiting_since']) / 60:.0f} min" if r["waiting_since"] else ""
            who = f"{r['name']} <{r['email']}>" if r["email"] else r["user_id"]  # a customer the shop signed in
            rows.append([r["id"], STATE_WORDS[r["state"]], r["agent"] or "", waiting, r["assistant"] or "",
                         who, (r["last"] or "")[:80]])
        online = ", ".join(self.handoff.online())
        return (rows, gr.update(choices=[row[0] for row in rows]), f"Online now (a console open): {online}",
                self.handoff.waiting())

    def _here(self, name: str) -> None:
        """The agent's console is open (it lists the inbox every few seconds): said at most every 15 s."""
        now = time.monotonic()
        if now - self.said.get(name, -1e9) >= 15:
            self.handoff.seen(name)
            self.said[name] = now

    def open(self, sid: str | None, request: gr.Request):
        """The picked chat, whole, and where it stands."""
        self._name(request)
        if not sid:
            return [], ""
        return self._shown(sid)

    def pick_row(self, data: gr.SelectData, request: gr.Request):
        """A click on a row of the table opens its chat, as picking it in the list does."""
        row = data.row_value or []
        sid = row[0] if row else None
        if not sid:
            return gr.update(), gr.update(), gr.update()
        return sid, *self.open(sid, request)

    def take(self, sid: str | None, request: gr.Request):
        name = self._name(request)
        if not sid:
            raise gr.Error("Pick a chat first.")
        holder = self.handoff.take(sid, name)
        if holder is not None:
            gr.Warning(f"{holder} already has this chat.")
        return self._shown(sid)

    def hand_back(self, sid: str | None, request: gr.Request):
        name = self._name(request)
        if not sid or not self.handoff.hand_back(sid, name):
            gr.Warning("Only the agent who has the chat can hand it back.")
        return self._shown(sid) if sid else ([], "")

    def reply(self, sid: str | None, text: str, request: gr.Request):
        """(chat, status, box): the reply stored for the customer; the box keeps a refused text."""
        name = self._name(request)
        text = (text or "").strip()
        if not sid or not text:
            return (*self._shown(sid), text) if sid else ([], "", text)
        canned = self._canned(sid)
        if text.startswith("/") and " " not in text:
            if text in canned:
                gr.Info(f"{text} expanded: edit it if you like, then press Enter to send.")
                return (*self._shown(sid), canned[text])
            gr.Warning(f"No canned response {text}; this chat's assistant has: {', '.join(canned) or 'none'}.")
            return (*self._shown(sid), text)
        if len(text) > MAX_REPLY_CHARS:
            gr.Warning(f"The reply is {len(text)} characters; at most {MAX_REPLY_CHARS}. Nothing was sent.")
            return (*self._shown(sid), text)
        text, cards = hide_cards(text)
        if cards:  # never stored, from a person either
            gr.Info("A card number in the reply was masked (only its last four digits were sent and kept).")
        try:
            self.handoff.reply(sid, name, text)
        except ValueError as e:
            gr.Warning(f"Not sent: {e}.")
            return (*self._shown(sid), text)
        return (*self._shown(sid), "")

    def _canned(self, sid: str) -> dict[str, str]:
        slug = self.handoff.assistant_of(sid)
        a = self.store.assistant(slug) if slug else None
        return a["canned"] if a else {}

    def _shown(self, sid: str):
        s = self.handoff.state(sid)
        holder = f" ({s['agent']})" if s["agent"] else ""
        shortcuts = ", ".join(f"`{k}`" for k in self._canned(sid))
        line = f"**{sid}**: {STATE_WORDS[s['state']]}{holder}" + (f" · canned: {shortcuts}" if shortcuts else "")
        return display(self.handoff.conversation(sid)), line


def inbox_panel() -> SimpleNamespace:
    with gr.Accordion("Handoff inbox", open=True, elem_id="inbox"):
        with gr.Row():
            online = gr.Markdown(elem_id="inbox-online")
            refresh_btn = gr.Button("Refresh", size="sm", scale=0, elem_id="inbox-refresh")
        find = gr.Textbox(label="Find a chat", placeholder="Words, an order number, a customer, a chat id · Enter "
                          "finds · empty: the inbox", lines=1, max_lines=1, elem_id="inbox-find")
        waiting = gr.Number(visible=False)  # how many chats wait: the tab's title shows it
        table = gr.Dataframe(headers=INBOX_COLUMNS, column_widths=INBOX_WIDTHS, interactive=False, wrap=True,
                             elem_id="inbox-table")
        pick = gr.Dropdown([], label="Chat", allow_custom_value=True, elem_id="inbox-pick")
        state = gr.Markdown(elem_id="inbox-state")
        chat = gr.Chatbot(height=360, sanitize_html=True, elem_id="inbox-chat")
        with gr.Row():
            take_btn = gr.Button("Take this chat", variant="primary", size="sm", elem_id="inbox-take")
            back_btn = gr.Button("Hand back to the assistant", size="sm", elem_id="inbox-hand-back")
        reply = gr.Textbox(placeholder="Reply to the customer · Enter sends · Shift+Enter starts a new line",
                           show_label=False, lines=1, submit_btn=False,
                           max_lines=8, elem_id="inbox-reply")
        send_btn = gr.Button("Send reply", size="sm", elem_id="inbox-send")
    return SimpleNamespace(**locals())


def wire_inbox(page: gr.Blocks, timer: gr.Timer, inbox: InboxHandlers, box: SimpleNamespace) -> None:
    private = dict(api_visibility="private")
    listing = [box.table, box.pick, box.online, box.waiting]
    for event in (page.load(inbox.rows, [box.find], listing, **private),
                  timer.tick(inbox.rows, [box.find], listing, show_progress="hidden", **private),
                  box.refresh_btn.click(inbox.rows, [box.find], listing, **private),
                  box.find.submit(inbox.rows, [box.find], listing, **private)):
        event.then(None, [box.waiting], None, js=TITLE_JS, **private)
    box.pick.input(inbox.open, [box.pick], [box.chat, box.state], **private)
    box.table.select(inbox.pick_row, None, [box.pick, box.chat, box.state], **private)
    timer.tick(inbox.open, [box.pick], [box.chat, box.state], show_progress="hidden", **private)
    box.take_btn.click(inbox.take, [box.pick], [box.chat, box.state], **private)
    box.back_btn.click(inbox.hand_back, [box.pick], [box.chat, box.state], **private)
    for trigger in (box.send_btn.click, box.reply.submit):
        trigger(inbox.reply, [box.pick, box.reply], [box.chat, box.state, box.reply], **private)
