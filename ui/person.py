"""The customer chat's side of a handoff to a person: the "talk to a person" button, the status
line (place in line, whether anyone of the team is online, who is answering), "back to the
assistant" while the chat waits, and the poll that shows a person's replies in the open tab. A
deployment with no agents or operators (`staffed` False) offers no person: the assistant answers.
Mixed into ChatHandlers (ui/handlers.py), whose current(), store, handoff, staffed and shown() it
uses."""
from __future__ import annotations

import gradio as gr

from ui.i18n import say


class PersonHandlers:
    def ask_person(self, uid, sid, request: gr.Request):
        """The "talk to a person" button: the chat waits for one; person_status's outputs."""
        uid, sid = self.current(uid, sid, request)
        if self.staffed:
            self.handoff.ask(sid)
        return self.person_status(uid, sid, request)

    def back_to_assistant(self, uid, sid, request: gr.Request):
        """While the chat waits (no person has taken it yet): the assistant answers again."""
        uid, sid = self.current(uid, sid, request)
        self.handoff.cancel(sid)
        return self.person_status(uid, sid, request)

    def person_status(self, uid, sid, request: gr.Request):
        """(status line, poll timer, person button, back button): where the chat stands with a person
        (the two buttons swap while it waits); the timer runs while one is involved, so their replies
        show without a reload."""
        uid, sid = self.current(uid, sid, request)
        s = self.handoff.state(sid) if self.staffed else {"state": "assistant"}
        if s["state"] == "waiting":
            line = say(request, "waiting" if self.handoff.online() else "waiting_offline", place=s["place"])
        elif s["state"] == "agent":
            line = say(request, "with_agent", agent=s["agent"])
        else:
            line = ""
        return (gr.update(value=line, visible=bool(line)), gr.Timer(active=s["state"] != "assistant"),
                gr.update(visible=self.staffed and s["state"] == "assistant"), gr.update(visible=s["state"] == "waiting"))

    def poll(self, uid, sid, seen, request: gr.Request):
        """Each second while a person is involved: (chatbot, *person_status, seen), the chatbot only
        when a message came (`seen`: how many the tab shows)."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        changed = len(messages) != seen
        return (self.shown(uid, sid) if changed else gr.update()), *self.person_status(uid, sid, request), len(messages)
