"""The console's "Customer data" (operators only): a customer asks what the shop keeps of them, or to
be forgotten. The operator names them as the inbox does (`visitor:...`, `login:...`, `customer:...`)
or by the e-mail address their shop signed them in with; sees how much there is; downloads all of it
as JSON (at /console/export/customer.json, an operator's download like the others); and deletes all of
it after confirming (storage/retention.py: overwritten in the file, logged with the operator's name)."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from urllib.parse import quote

import gradio as gr

from storage import retention
from ui import downloads

log = logging.getLogger("pagedchat.privacy")


class CustomerDataHandlers:
    def __init__(self, store, operator) -> None:
        """operator: ui/operator.OperatorHandlers, which says who is an operator."""
        self.store, self.operator = store, operator

    def _user(self, who: str | None, request: gr.Request) -> str | None:
        self.operator._check(request)
        return retention.resolve(self.store, who or "")

    def look_up(self, who: str | None, request: gr.Request):
        """(what there is of them, the download link, the delete button shown, the confirmation hidden)"""
        user = self._user(who, request)
        if user is None:
            return (f"No customer {who.strip()!r}: give an id as the inbox shows it, or a signed-in customer's e-mail "
                    "address." if (who or "").strip() else ""), "", gr.update(visible=False), gr.update(visible=False)
        data = retention.customer_data(self.store, user)
        person = data["user"]
        named = f" ({person['name']}, {person['email']})" if person.get("email") else ""
        chats = data["chats"]
        messages = sum(len(c["messages"]) for c in chats)
        when = [m["created"] for c in chats for m in c["messages"] if m["created"]]
        span = (f", from {time.strftime('%Y-%m-%d', time.gmtime(min(when)))} to "
                f"{time.strftime('%Y-%m-%d', time.gmtime(max(when)))}" if when else "")
        summary = f"**{user}**{named}: {len(chats)} chat(s), {messages} message(s){span}."
        link = downloads.links(("Download all of it (JSON)", f"customer.json?who={quote(user, safe='')}"))
        return summary, link, gr.update(visible=True), gr.update(visible=False)

    def ask(self, who: str | None, request: gr.Request):
        user = self._user(who, request)
        return gr.update(visible=user is not None)

    def erase(self, who: str | None, request: gr.Request):
        """(the result line, the download link gone, the delete button and confirmation hidden)"""
        user = self._user(who, request)
        if user is None:
            return "Nothing was deleted: no such customer.", "", gr.update(visible=False), gr.update(visible=False)
        gone = retention.forget(self.store, user)
        log.info("operator %s erased %s: %d chats, %d messages", request.username, user, gone["chats"],
                 gone["messages"])
        return (f"Deleted {gone['chats']} chat(s) and {gone['messages']} message(s) of **{user}**, and the customer's "
                "record."), "", gr.update(visible=False), gr.update(visible=False)


def customer_data_panel() -> SimpleNamespace:
    with gr.Accordion("Customer data (access and erasure)", open=False, elem_id="customer-data"):
        who = gr.Textbox(label="Customer", placeholder="visitor:…, login:…, customer:… as the inbox shows, or an "
                         "e-mail address · Enter looks up", lines=1, max_lines=1, elem_id="customer-who")
        summary = gr.Markdown(elem_id="customer-summary")
        link = gr.HTML(elem_id="customer-download")
        erase_btn = gr.Button("Delete all of it…", variant="stop", size="sm", visible=False, elem_id="customer-erase")
        with gr.Row(visible=False, elem_id="customer-confirm") as confirm:
            gr.Markdown("Delete **all** of this customer's chats and messages? This cannot be undone.")
            yes_btn = gr.Button("Yes, delete everything", variant="stop", size="sm", elem_id="customer-erase-yes")
            no_btn = gr.Button("Cancel", size="sm", elem_id="customer-erase-no")
    return SimpleNamespace(**locals())


def wire_customer_data(handlers: CustomerDataHandlers, box: SimpleNamespace) -> None:
    private = dict(api_visibility="private")
    shown = [box.summary, box.link, box.erase_btn, box.confirm]
    box.who.submit(handlers.look_up, [box.who], shown, **private)
    box.erase_btn.click(handlers.ask, [box.who], [box.confirm], **private)
    box.no_btn.click(lambda: gr.update(visible=False), None, [box.confirm], **private)
    box.yes_btn.click(handlers.erase, [box.who], shown, **private)
