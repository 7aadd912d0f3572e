"""The chat pane's logic, kept apart from Gradio widgets: one streamed turn (knowledge retrieved,
prompt built token-exactly, a tool call run, reply stored with its ids and timings). How stored
messages are shown is ui/display.py."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
from collections.abc import AsyncIterator

from engine.client import EngineClient, EngineDeadError, EngineOverloadedError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from server.limits import TooManyRequestsError, UserLimiter
from engine.tool_calls import ToolCallParser
from engine.tools import NO_CALL_GRAMMAR, ToolPlan
from storage import StoreError, StoreUnavailable
from ui import actions
from ui.flights import InFlight, TurnsInFlight
from ui.conversation import build_prompt, call_message, chat_messages, extend, template_text
from ui.display import TYPING, display, in_flight
from ui.reply import ReplyWriter
from ui.grounding import ground, mark
from ui.i18n import Refusal


class ReplyCut(EngineDeadError):
    """A reply cut after it had started (its engine went away): what was written is stored, marked
    interrupted, and the turn counts as sent. `key`: what the customer is told (ui.i18n.SAID)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def unnamed(session: dict, history: list) -> bool:
    """Whether a chat waits for its first message to name it (chat_title)."""
    return session["title"] == "New chat" and not history


def chat_title(text: str, limit: int = 40) -> str:
    """A new chat's title from its first message: one line, cut at a word where one ends within the
    limit (with an ellipsis), else at the limit (a long word, text without spaces)."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line or "New chat"
    cut = line[:limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut[limit // 2:] else cut).rstrip(" ,.;:") + "…"


def after_call(tokenizer, context_ids: list[int], messages: list[dict], record: dict, plan, encode) -> list[int]:
    """The prompt after a call: what the engine saw (prompt and call), then the call's result as a
    tool message and the assistant's turn, rendered by the template (token for token where it can)."""
    text = template_text(tokenizer, messages + [{"role": "tool", "tool_call_id": record["id"],
                                                 "content": record["result"]}], plan)
    return extend(tokenizer, context_ids, text, encode).token_ids


def with_grammar(params: SamplingParams, grammar: str) -> SamplingParams:
    stepped = copy.copy(params)
    stepped.structured_outputs = StructuredOutputsParams(grammar=grammar)
    return stepped


@dataclasses.dataclass
class Prepared:
    """A turn's prompt and what it was built from (ChatService._prepare)."""
    prompt_ids: list[int]
    shown: list[dict]  # the chat's messages, the new one included
    last_text: str  # the customer's message the reply answers
    window: list[dict]  # the history the prompt holds
    stored: int | None  # the new message's id (None when regenerating)
    tools: list
    plan: ToolPlan | None
    system: str  # the system prompt with the knowledge chunks
    encode: object  # the grounding's encoder, or None
    grounding: object
    hosts: frozenset[str] | None = None  # the sites the assistant vouches for (ui/links.py; the customer chat)
    email: str = ""  # a signed-in customer's e-mail address, as their shop gave it (server/customers.py)


class ChatService(TurnsInFlight):
    """Everything a chat event needs: the engine client, the store, the turns in flight (ui/flights.py)."""

    def __init__(self, client: EngineClient, store, limiter: UserLimiter | None = None,
                 salt_by_user: bool = False, render=display, tools_for=None, on_handoff=None,
                 retrieve=None, hosts_for=None) -> None:
        """limiter: the per-user cap shared with the API. salt_by_user: each user's turns reuse only
        their own cached prefixes (cache_salt = the user). render: stored messages -> what the
        chatbot shows (display, or customer_display). tools_for(session): the chat's tools
        (ui/actions.ChatTool); on_handoff(session_id): what the built-in handoff tool does;
        retrieve(session, history, text): the knowledge chunks for a turn (ui/grounding.py).
        hosts_for(session): the sites whose links the chat shows as links (ui/links.py)."""
        self.render = render
        self.tools_for = tools_for or (lambda session: [])
        self.on_handoff = on_handoff or (lambda session_id: None)
        self.retrieve = retrieve or (lambda session, history, text: [])
        self.hosts_for = hosts_for or (lambda session: None)
        self.client = client
        self.store = store
        self.limiter = limiter or UserLimiter(0)
        self.salt_by_user = salt_by_user
        self.active: dict[str, dict[str, EngineClient]] = {}  # browser tab (session_hash) -> its requests' engines
        self.busy: dict[str, InFlight] = {}  # chat -> its turn in flight (handlers share one event loop)

    def turn(self, user: str, session_id: str, text: str, params: SamplingParams, tab: str,
             regenerate: bool = False, client: EngineClient | None = None) -> AsyncIterator[tuple[list, bool]]:
        """Yields (messages for display, done). Stores the user message (unless regenerating) and
        the reply as it grows, so a stop, a closed tab or a killed process keeps what was written.
        One turn at a time per chat: a second (another tab) is refused, so turns always alternate;
        and at most the per-user cap of turns at once across the user's chats (TooManyRequestsError)."""
        flight = InFlight(tab)
        flight.steps = self._guarded(flight, user, session_id, text, params, tab, regenerate, client or self.client)
        return self._follow(flight)

    async def _guarded(self, flight: InFlight, user, session_id, text, params, tab, regenerate, client):
        """The turn, registered as the chat's one turn in flight and holding a slot of the user's cap
        until it ends, however it ends (finished, cancelled, closed by stop)."""
        self.refuse_if_busy(session_id, tab)
        with self.limiter.slot(user):
            self.busy[session_id] = flight
            try:
                async with contextlib.aclosing(self._turn(user, session_id, text, params, tab, regenerate, client)) as turn:
                    async for update in turn:
                        yield update
            finally:
                if self.busy.get(session_id) is flight:
                    del self.busy[session_id]
                flight.ended.set()

    def _prepare(self, info, user, session_id, text, params, regenerate) -> Prepared:
        """Everything before the engine, in a worker thread (the database and the tokenizer stay off
        the event loop): the chat, its history, tools and knowledge, the prompt; a new message is
        stored. Refusals raise ValueError, a database that cannot serve StoreUnavailable."""
        session = self.store.session(user, session_id)
        if session is None:
            raise Refusal("not_yours")
        history = self.store.messages(user, session_id)
        model = info.name
        tools = self.tools_for(session)
        plan = ToolPlan([t.tool for t in tools], "auto", False) if tools else None
        last_user = history[-1] if regenerate and history and history[-1]["role"] == "user" else None
        if regenerate and last_user is None:
            raise Refusal("nothing_to_regenerate")
        before = history[:-1] if regenerate else history
        chunks = self.retrieve(session, before, last_user["content"] if regenerate else text)
        grounding = ground(info.tokenizer, session["system_prompt"], chunks, info.block_size) if chunks else None
        mark(session_id, grounding, info.block_size)
        system = session["system_prompt"] + (grounding.text if grounding else "")
        encode = functools.partial(grounding.encode, info.tokenizer) if grounding else None
        if regenerate:
            prompt_ids, last_text = last_user["token_ids"], last_user["content"]
            window = history[:-1][last_user.get("trimmed_turns") or 0:]
            same_model = not history[:-1] or history[-2].get("model") in (None, "", model)
            if not prompt_ids or not same_model:  # built for another model: render again
                prompt_ids = build_prompt(info.tokenizer, system, history[:-1], last_user["content"], model,
                                          self._limit(info, params), plan, encode).token_ids
            return Prepared(prompt_ids, history, last_text, window, None, tools, plan, system, encode, grounding,
                            self.hosts_for(session), self.store.user_email(user))
        prompt = build_prompt(info.tokenizer, system, history, text, model, self._limit(info, params), plan, encode)
        if len(prompt.token_ids) >= info.max_model_len:
            raise Refusal("too_long", tokens=len(prompt.token_ids), limit=info.max_model_len)
        stored = self.store.add_message(user, session_id, "user", text, prompt.token_ids, model=model,
                                        trimmed_turns=prompt.trimmed)
        if unnamed(session, history):
            self.store.update_session(user, session_id, title=chat_title(text))
        return Prepared(prompt.token_ids, self.store.messages(user, session_id), text, history[prompt.trimmed:],
                        stored, tools, plan, system, encode, grounding, self.hosts_for(session),
                        self.store.user_email(user))

    async def _turn(self, user, session_id, text, params, tab, regenerate, client: EngineClient):
        """The turn on `client`, the engine of the chat's model (engine.fleet)."""
        info = client.info
        if info is None:
            raise EngineDeadError(client.error or "the model is still loading")
        p = await asyncio.to_thread(self._prepare, info, user, session_id, text, params, regenerate)
        prompt_ids, shown, last_text, window, stored = p.prompt_ids, p.shown, p.last_text, p.window, p.stored
        tools, plan, system, encode = p.tools, p.plan, p.system, p.encode
        model = info.name
        render = functools.partial(self.render, hosts=p.hosts)
        if not regenerate:
            yield render(shown) + [TYPING], False  # the message shows at once; the reply streams under it
        reply = ReplyWriter(self.store, user, session_id, prompt_ids, model)
        reply.sources = p.grounding.sources() if p.grounding else []
        salt = f"user:{user}" if self.salt_by_user else None
        try:
            first = params
            # all the customer wrote, and the address their shop signed them in with
            said = "\n".join([m["content"] for m in shown if m["role"] == "user"] + [p.email])
            if plan is not None:
                tool = actions.triggered(tools, last_text, said)
                grammar = ToolPlan(actions.narrowed(plan.tools, said), tool.name if tool else "auto", False).grammar
                first = with_grammar(params, grammar)
            parser = ToolCallParser()
            async with contextlib.aclosing(self._generate(client, prompt_ids, first, tab, session_id, salt)) as stream:
                async for out in stream:  # a reply without a call is stored as written, token for token
                    parser.feed(out.delta_text)
                    visible = parser.content if parser.in_call else out.outputs[0].text
                    await reply.save(out, "streaming", visible)
                    yield render(shown + [in_flight(visible, [], parser.in_call)]), False
            if parser.calls and reply.last.outputs[0].finish_reason == "stop":
                call, tool = parser.calls[0], next(t for t in tools if t.name == parser.calls[0].name)
                record = {"id": call.id, "name": call.name, "arguments": call.arguments,
                          "text": reply.last.outputs[0].text}
                yield render(shown + [in_flight(parser.content, [record], True)]), False
                result = await asyncio.to_thread(actions.run, tool, call.arguments, self.store,
                                                 lambda reason: self.on_handoff(session_id), said)
                record.update(result=result.text, error=result.error)
                messages = chat_messages(system, window + [{"role": "user", "content": last_text}]) + [
                    call_message([record])]
                prompt_2 = after_call(info.tokenizer, prompt_ids + reply.last.outputs[0].token_ids, messages, record,
                                      plan, encode)
                reply.next_step(prompt_2, [record])
                answer = self._generate(client, prompt_2, with_grammar(params, NO_CALL_GRAMMAR), tab, session_id, salt)
                async with contextlib.aclosing(answer) as stream:
                    async for out in stream:
                        await reply.save(out, "streaming")
                        yield render(shown + [in_flight(out.outputs[0].text, [record], False)]), False
        except (ValueError, EngineDeadError, EngineOverloadedError, TooManyRequestsError) as e:
            if reply.last is None:  # (a remote engine applies its own per-user cap)
                if not regenerate:  # refused at admission: the text stays in the box, unsent
                    await asyncio.to_thread(self.store.delete_messages_from, user, session_id, stored)
                raise
            await reply.finish("interrupted")  # cut mid-reply (an engine went away): kept, marked, the chat goes on
            raise ReplyCut(str(e), "reply_cut") from e
        except StoreUnavailable as e:  # the message was stored: the turn counts as sent, the reply as cut
            raise ReplyCut(f"{e}. What the assistant wrote so far may not be saved; try again in a moment.",
                           "reply_cut_storage") from None
        except StoreError:
            raise Refusal("deleted_mid_reply") from None
        except (asyncio.CancelledError, GeneratorExit):  # Stop, a closed tab, or the event closed
            await reply.finish("abort")
            raise
        reason = reply.last.outputs[0].finish_reason if reply.last else None
        if reason == "abort" and client.state == "draining":
            reason = "interrupted"  # ended by the server's shutdown, not by the customer
        await reply.finish(reason)
        yield render(await asyncio.to_thread(self.store.messages, user, session_id)), True

    @staticmethod
    def _limit(info, params: SamplingParams) -> int:
        """Tokens a prompt may take: the context less room for the reply (at most a quarter of it)."""
        quarter = info.max_model_len // 4
        return info.max_model_len - min(params.max_tokens or quarter, quarter)

