"""The chat turn's events, for ChatHandlers (ui/handlers.py): stage a message, send it, stop,
regenerate, edit and resend, a closed tab. The database is used from worker threads: a locked or
missing one refuses a turn with the text back in the box, never stalls the event loop that serves
everyone else."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import gradio as gr

from engine.client import EngineDeadError, EngineOverloadedError
from server.limits import TooManyRequestsError
from storage import StoreError, StoreUnavailable
from ui import assistants
from ui.assistants import CHAT_REPETITION_PENALTY
from ui.cards import hide_cards
from ui.chat import ReplyCut, chat_title, unnamed
from ui.display import TYPING, event_index, plain_text, text_of
from ui.i18n import Refusal, say, wants_person

REFUSALS = (ValueError, EngineDeadError, EngineOverloadedError, TooManyRequestsError, StoreError)  # warnings
MODEL_WAIT_S = 600  # how long a message sent while the model loads waits for it
log = logging.getLogger("pagedchat.ui")


def refusal_key(e: Exception) -> str | None:
    """What a customer is told (a ui.i18n.SAID key) when a turn ends with `e`; None: its own words."""
    if isinstance(e, ReplyCut):
        return e.key
    if isinstance(e, StoreUnavailable):
        return "storage_busy"
    if isinstance(e, EngineOverloadedError):
        return "busy"
    if isinstance(e, TooManyRequestsError):
        return "too_many"
    if isinstance(e, EngineDeadError):
        return "unavailable"  # the engine is loading, gone, or cannot be reached
    return None


class TurnHandlers:
    """Mixed into ChatHandlers, whose attributes it uses: client, store, service (ui/chat.ChatService),
    handoff, display, demo, current() (the user and their chat) and engine_for() (the chat's engine)."""

    def _version(self, uid: str, sid: str) -> dict | None:
        """The assistant version the chat started with (the customer chat; None on the demo page)."""
        if self.demo:
            return None
        session = self.store.session(uid, sid)
        if session is None:
            raise Refusal("not_yours")
        return self.store.assistant(session["assistant"], session["assistant_version"])

    def _params(self, client, version: dict | None, sliders: tuple):
        """The demo page: the sliders' values over the model's own defaults. The customer chat: the
        sampling of the assistant version the chat started with. Refused while no model is loaded."""
        info = client.info
        if info is None:
            raise EngineDeadError(client.error or "the model is still loading")
        if version is not None:
            return assistants.sampling_for(info, version)
        temperature, top_p, max_new, penalty = sliders
        return info.default_sampling(temperature=temperature, top_p=top_p, max_tokens=int(max_new),
                                     repetition_penalty=CHAT_REPETITION_PENALTY if penalty is None else penalty)

    def stage(self, text, history, sid=None):
        """Browser only, unqueued: the message shows at once (a card number in it masked, as `send`
        stores it) and the box clears; `send` follows. While the chat's reply is still being written
        the text stays in the box, and `send` says why."""
        text = (text or "").strip()
        if not text:
            return gr.update(), gr.update(), ""
        if sid is not None and sid in self.service.busy:
            return gr.update(), gr.update(), text
        shown = {"role": "user", "content": text_of({"role": "user", "content": hide_cards(text)[0]})}
        return "", list(history or []) + [shown, TYPING], text

    async def send(self, uid, sid, text, temp=None, p=None, max_new=None, penalty=None, request: gr.Request = None):
        """A turn. The sliders (temp .. penalty) are the demo page's inputs; the customer chat has none.
        The box is left alone (stage cleared it, and the customer may be typing the next message) but
        for a refused message, which goes back into it. In the customer chat, a message asking for a
        person, or sent while the chat waits for one or is with one, is stored for the person and the
        model does not answer. The database is used from worker threads: a locked or missing one
        refuses this turn (the text back in the box), never the event loop that serves everyone else.
        A card number is masked before anything sees it (ui/cards.py), and the customer is told."""
        raw, (text, cards) = text, hide_cards((text or "").strip())
        if not text:
            yield gr.update(), gr.update()
            return
        if cards:
            gr.Info(say(request, "card_hidden"))
        try:
            uid, sid = await asyncio.to_thread(self.current, uid, sid, request)
            self.service.refuse_if_busy(sid, request.session_hash)  # before anything is stored
            if not self.demo and await asyncio.to_thread(self._for_person, uid, sid, text):
                yield await self._shown(uid, sid), gr.update()
                return
            version = await asyncio.to_thread(self._version, uid, sid)
            client = self.engine_for(version)
            if client.state == "loading":  # a fresh start: the message waits for the model, on screen
                history = await asyncio.to_thread(self.shown, uid, sid)
                waiting = {"role": "assistant", "content": f"*{say(request, 'loading')}*"}
                yield history + [{"role": "user", "content": text_of({"role": "user", "content": text})},
                                 waiting], gr.update()
                await asyncio.to_thread(client.wait_ready, MODEL_WAIT_S)
            params = self._params(client, version, (temp, p, max_new, penalty))
            turn = self.service.turn(uid, sid, text, params, request.session_hash, client=client)
            async with contextlib.aclosing(turn):
                async for messages, _ in turn:
                    yield messages, gr.update()
        except REFUSALS as e:
            self._warn(e, request)
            sent = isinstance(e, ReplyCut)  # else unsent: the message goes back into the box, as typed
            yield await self._after_refusal(e, uid, sid), gr.update() if sent else raw

    def _for_person(self, uid: str, sid: str, text: str) -> bool:
        """The customer chat: a message asking for a person, or sent while one is involved, is stored
        for them and the chat waits (True); else the assistant answers (False), as it always does
        where the deployment has no one to answer (not staffed)."""
        if not self.staffed or (self.handoff.state(sid)["state"] == "assistant" and not wants_person(text)):
            return False
        first = unnamed(self.store.session(uid, sid), self.store.messages(uid, sid))
        self.store.add_message(uid, sid, "user", text, [])
        if first:  # named as the model's turns name a chat (ui/chat.py)
            self.store.update_session(uid, sid, title=chat_title(text))
        self.handoff.ask(sid)
        return True

    async def _after_refusal(self, e: Exception, uid: str | None, sid: str | None):
        """The chatbot after a refused event: the chat as stored, but where this tab's reply is still
        streaming, which keeps the screen."""
        streaming = isinstance(e, Refusal) and e.key in ("still_answering", "wait_for_reply")
        return gr.update() if streaming else await self._shown(uid, sid)

    async def _shown(self, uid: str | None, sid: str | None):
        """The chat as stored, for the chatbot; where the database cannot say, the screen stays as it is."""
        if not uid or not sid:
            return gr.update()
        try:
            return await asyncio.to_thread(self.shown, uid, sid)
        except StoreError:
            return gr.update()

    def _warn(self, e: Exception, request: gr.Request) -> None:
        """A refused or cut turn, said in the customer's language. The demo page, whose visitors
        watch the engine, shows an engine's own words (queue lengths, what failed)."""
        if isinstance(e, StoreUnavailable):
            log.warning("chat storage: %s", e)
        key = refusal_key(e)
        if isinstance(e, Refusal):
            gr.Warning(say(request, e.key, **e.values))
        elif key is None or (self.demo and key != "storage_busy"):
            gr.Warning(str(e))
        else:
            gr.Warning(say(request, "unavailable_alone" if key == "unavailable" and not self.staffed else key))

    async def stop(self, uid, sid, request: gr.Request):
        """Stop: the reply ends now (its engine request aborted); the chat as stored, the reply
        marked stopped and holding what was on screen."""
        uid, sid = await asyncio.to_thread(self.current, uid, sid, request)
        await self.service.stop(request.session_hash, sid)
        return await self._shown(uid, sid)

    async def shown_after_stop(self, uid, sid, request: gr.Request):
        """After Stop's own update: the chat as stored, again (a cancelled turn's last update, sent
        slowly on a busy server, can land after Stop's and would leave the reply without its footer)."""
        uid, sid = await asyncio.to_thread(self.current, uid, sid, request)
        flight = self.service.busy.get(sid)
        if flight is not None:  # the turn is still storing its reply: show it once stored, marked
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flight.ended.wait(), 10)
        return await self._shown(uid, sid)

    async def regenerate(self, uid, sid, temp=None, p=None, max_new=None, penalty=None, request: gr.Request = None):
        try:
            uid, sid = await asyncio.to_thread(self.current, uid, sid, request)
            self.service.refuse_if_busy(sid, request.session_hash, own="wait_for_reply")
            if not await asyncio.to_thread(self._clear_last_reply, uid, sid):
                gr.Warning(say(request, "person_busy"))
                yield await self._shown(uid, sid)
                return
            version = await asyncio.to_thread(self._version, uid, sid)
            client = self.engine_for(version)
            params = self._params(client, version, (temp, p, max_new, penalty))
            turn = self.service.turn(uid, sid, "", params, request.session_hash, regenerate=True, client=client)
            async with contextlib.aclosing(turn):
                async for messages, _ in turn:
                    yield messages
        except REFUSALS as e:
            self._warn(e, request)
            yield await self._after_refusal(e, uid, sid)

    def _clear_last_reply(self, uid: str, sid: str) -> bool:
        """Before regenerating: the last reply goes. False (nothing changed) while a person has the chat."""
        if self.handoff.state(sid)["state"] != "assistant":
            return False
        history = self.store.messages(uid, sid)
        if history and history[-1]["role"] == "assistant":
            self.store.delete_messages_from(uid, sid, history[-1]["id"])
        return True

    async def edit_from_here(self, uid, sid, temp=None, p=None, max_new=None, penalty=None,
                             data: gr.EditData = None, request: gr.Request = None):
        """Edit and resend: the edited message and everything after it leave the chat (kept in the
        database as a branch); the edited text is sent as a new turn on the untouched history."""
        index = event_index(data)
        if index is None:
            yield gr.update(), gr.update()
            return
        try:
            uid, sid = await asyncio.to_thread(self.current, uid, sid, request)
            self.service.refuse_if_busy(sid, request.session_hash, own="wait_for_reply")
            refused = await asyncio.to_thread(self._branch_at, uid, sid, index)
        except REFUSALS as e:
            self._warn(e, request)
            yield await self._after_refusal(e, uid, sid), gr.update()
            return
        if refused:
            gr.Warning(say(request, refused))
            yield await self._shown(uid, sid), gr.update()
            return
        async for update in self.send(uid, sid, plain_text(data.value), temp, p, max_new, penalty, request):
            yield update

    def _branch_at(self, uid: str, sid: str, index: int) -> str | None:
        """The chat branches before its message `index` (the customer's own); else why not (a `say` key)."""
        messages = self.store.messages(uid, sid)
        if self.handoff.state(sid)["state"] != "assistant":
            return "no_edit_with_person"
        if not 0 <= index < len(messages) or messages[index]["role"] != "user":
            return "own_messages"
        self.store.branch_from(uid, sid, messages[index]["id"])
        return None

    async def tab_closed(self, request: gr.Request) -> None:
        await self.service.close_tab(request.session_hash)
