"""The customer chat's side of a handoff to a person: the "talk to a person" button, the status
line (place in line, whether anyone of the team is online, who is answering), "back to the
assistant" while the chat waits, and the poll that shows a person's replies in the open tab. A
deployment with no agents or operators (`staffed` False) offers no person: the assistant answers.
Mixed into ChatHandlers (ui/handlers.py), whose current(), store, handoff, staffed, shown() and
version_of() it uses. Outside the assistant's team hours (ui/hours.py) the line says them."""
from __future__ import annotations

import time

import gradio as gr

from ui import hours
from ui.i18n import language, say


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
            line = self._waiting_line(uid, sid, s["place"], request)
        elif s["state"] == "agent":
            line = say(request, "with_agent", agent=s["agent"])
        else:
            line = ""
        return (gr.update(value=line, visible=bool(line)), gr.Timer(active=s["state"] != "assistant"),
                gr.update(visible=self.staffed and s["state"] == "assistant"), gr.update(visible=s["state"] == "waiting"))

    def _waiting_line(self, uid, sid, place: int, request: gr.Request) -> str:
        """Outside the assistant's team hours: the hours and when the team is next in; else whether
        anyone of the team has a console open."""
        team = hours.parse((self.version_of(self.store.session(uid, sid) or {}) or {}).get("hours"))
        now = time.time()
        if team is not None and not team.open_at(now):
            lang = language(request)
            return say(request, "waiting_closed", place=place, hours=team.describe(lang), next=team.when(now, lang))
        return say(request, "waiting" if self.handoff.online() else "waiting_offline", place=place)

    def poll(self, uid, sid, seen, request: gr.Request):
        """Each second while a person is involved: (chatbot, *person_status, seen), the chatbot only
        when a message came (`seen`: how many the tab shows)."""
        uid, sid = self.current(uid, sid, request)
        messages = self.store.messages(uid, sid)
        changed = len(messages) != seen
        return (self.shown(uid, sid) if changed else gr.update()), *self.person_status(uid, sid, request), len(messages)
