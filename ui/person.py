"""The customer chat's side of a handoff to a person: the "talk to a person" button, the status
line (place in line, who is answering) and the poll that shows a person's replies in the open tab.
Mixed into ChatHandlers (ui/handlers.py), whose current(), store, handoff, display and
hosts_of it uses."""
from __future__ import annotations

import gradio as gr

from ui.i18n import say


class PersonHandlers:
    def ask_person(self, uid, sid, request: gr.Request):
        """The "talk to a person" button: the chat waits for one; (status line, poll timer)."""
        uid, sid = self.current(uid, sid, request)
        self.handoff.ask(sid)
        return self.person_status(uid, sid, request)

    def person_status(self, uid, sid, request: gr.Request):
        """(status line, poll timer): where the chat stands with a person; the timer runs while one
        is involved, so their replies show without a reload."""
        uid, sid = self.current(uid, sid, request)
        s = self.handoff.state(sid)
        if s["state"] == "waiting":
            line = say(request, "waiting", place=s["place"])
        elif s["state"] == "agent":
            line = say(request, "with_agent", agent=s["agent"])
        else:
            line = ""
        return gr.update(value=line, visible=bool(line)), gr.Timer(active=s["state"] != "assistant")

    def poll(self, uid, sid, seen, request: gr.Request):
        """Each second while a person is involved: (chatbot, status, timer, seen), the chatbot only
        when a message came (`seen`: how many the tab shows)."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        status, timer = self.person_status(uid, sid, request)
        changed = len(messages) != seen
        return (self.display(messages, self.hosts_of(self.store.session(uid, sid))) if changed
                else gr.update()), status, timer, len(messages)
