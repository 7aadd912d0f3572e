"""The chat turns in flight, for ChatService (ui/chat.py): one turn at a time per chat (`busy`), the
engine requests each browser tab has open (`active`), and what Stop and a closed tab do to them."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator

from engine.client import EngineClient
from engine.sampling_params import SamplingParams
from ui.i18n import Refusal


@dataclasses.dataclass
class InFlight:
    """A chat's turn in flight: the tab it streams to, its generator (stop closes it, saying so in
    `closing`) and an event set when it has ended."""
    tab: str
    steps: AsyncGenerator | None = None
    closing: bool = False  # stop is closing the turn's generator
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class TurnsInFlight:
    """Mixed into ChatService, which sets `busy` (chat -> its turn in flight) and `active` (browser
    tab -> its engine requests' clients); the handlers share one event loop."""
    busy: dict[str, InFlight]
    active: dict[str, dict[str, EngineClient]]

    @staticmethod
    async def _follow(flight: InFlight):
        """What the event iterates: the turn's updates, until they end or stop closes the turn. The
        event never touches a turn stop is closing (its generator is busy then): it waits for the
        end and stops quietly."""
        try:
            while not flight.closing:
                try:
                    update = await anext(flight.steps)
                except StopAsyncIteration:
                    return
                yield update
        finally:
            if flight.closing:
                await flight.ended.wait()
            else:
                await flight.steps.aclose()

    def refuse_if_busy(self, session_id: str, tab: str, own: str = "still_answering") -> None:
        """Turns alternate: while the chat's reply is being written, in this tab (a Refusal with the
        `own` key) or another, nothing may start a turn or change the chat."""
        flight = self.busy.get(session_id)
        if flight is not None:
            raise Refusal(own if flight.tab == tab else "already_answering")

    async def _generate(self, client: EngineClient, prompt_ids: list[int], params: SamplingParams, tab: str,
                        session_id: str, salt):
        """One engine request, aborted if the turn is left early; the tab can stop it meanwhile."""
        request_id = f"chat-{uuid.uuid4().hex[:12]}"
        self.active.setdefault(tab, {})[request_id] = client
        try:
            stream = client.generate(prompt_ids, params, request_id=request_id, session_id=session_id,
                                          cache_salt=salt)
            async with contextlib.aclosing(stream):  # leaving early aborts the engine request
                async for out in stream:
                    yield out
        finally:
            self.active.get(tab, {}).pop(request_id, None)

    async def stop(self, tab: str, session_id: str, wait_s: float = 5.0) -> None:
        """Stop: the tab's engine requests are aborted now, and the chat's turn ends with its reply
        stored as shown, marked "abort". Waits at most `wait_s` for the turn to end."""
        self.abort_tab(tab)
        flight = self.busy.get(session_id)
        if flight is not None:
            await self._end(flight, wait_s)

    async def close_tab(self, tab: str, wait_s: float = 5.0) -> None:
        """A closed tab: its engine requests are aborted and its turns end as stopped ones do."""
        self.abort_tab(tab)
        for flight in [f for f in self.busy.values() if f.tab == tab]:
            await self._end(flight, wait_s)

    @staticmethod
    async def _end(flight: InFlight, wait_s: float) -> None:
        """Ends a turn whose engine request was aborted. Gradio's cancel does not always reach the
        turn: one parked between two updates (its event's task cancelled while not inside it, or the
        tab gone) would never be resumed to read the abort, so it is closed here; one awaiting the
        engine reads the abort's final output, then parks or ends."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not flight.ended.is_set() and loop.time() < deadline:
            if not flight.steps.ag_running:
                flight.closing = True
                await flight.steps.aclose()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flight.ended.wait(), 0.05)

    def abort_tab(self, tab: str) -> int:
        requests = self.active.pop(tab, {})
        for rid, client in requests.items():
            client.abort(rid)
        return len(requests)
