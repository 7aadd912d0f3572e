"""The operator's controls: which model and quantization serve, simulated customers, the prefix
cache, and the review of rated replies. Only operators (`--admin NAME`, logged in) see them, and
every handler checks again: a visitor calling the endpoint directly is refused. The engine decides
what applies (EngineClient.quantization_choices / switch_model); this only asks."""
from __future__ import annotations

import asyncio

import gradio as gr

from engine.client import EngineClient, EngineDeadError
from ui import transfer
from ui.simulate import start_simulated_chats

FEEDBACK_COLUMNS = ["when", "rating", "comment", "user", "chat", "reply"]


class OperatorHandlers:
    def __init__(self, client: EngineClient, store, models: dict[str, str | None], quantization: str | None,
                 operators: set[str]) -> None:
        """models: label -> model argument (None = the embedded default), the first loaded at start
        with `quantization` (None: its default). operators: login names allowed to operate."""
        self.client = client
        self.store = store
        self.models = models
        self.quantization = quantization
        self.operators = operators
        self.picked: tuple[str, str | None] | None = None  # (model label, quantization) of the last switch

    def is_operator(self, request: gr.Request | None) -> bool:
        return getattr(request, "username", None) in self.operators

    def _check(self, request: gr.Request | None) -> None:
        if not self.is_operator(request):
            raise gr.Error("Only operators can do this.")

    def show_controls(self, request: gr.Request):
        """On page load: the operator column for operators, nothing for visitors."""
        return gr.update(visible=self.is_operator(request))

    def initial_choices(self) -> tuple[list[str], str | None]:
        """Quantization choices of the starting model, and the one in force."""
        choices = self.client.quantization_choices(next(iter(self.models.values())))
        in_force = self.quantization if self.quantization in choices else (choices[0] if choices else None)
        return choices, in_force

    def in_force(self, request: gr.Request):
        """On page load: the model and quantization the last switch loaded (the page was built with the
        starting ones, and a reload showed those whatever served)."""
        if not self.is_operator(request) or self.picked is None:
            return gr.update(), gr.update()
        label, quant = self.picked
        choices = self.client.quantization_choices(self.models[label])
        return gr.update(value=label), gr.update(choices=choices, value=quant)

    def quant_options(self, label: str, request: gr.Request):
        self._check(request)
        choices = self.client.quantization_choices(self.models[label])
        return gr.update(choices=choices, value=choices[0] if choices else None)

    async def switch(self, label: str, quant: str, request: gr.Request):
        self._check(request)
        serving = self.client.info.name if self.client.info else "the current model"
        yield f"Loading **{label}** ({quant})… the current model keeps answering until it is ready."
        try:
            result = await asyncio.to_thread(self.client.switch_model, self.models[label], quant)
        except ValueError as e:
            yield f"❌ {e}. Still serving **{serving}**."
            return
        self.picked = (label, quant)
        yield f"✅ {result}. Sessions keep their history; their next turn re-reads it once."

    async def simulate(self, n, request: gr.Request):
        self._check(request)
        if not self.client.ready:
            return "The engine is not ready yet."
        started = start_simulated_chats(self.client, int(n or 16))
        return f"Started {started} simulated chats (3 turns each, then they stop). Watch the panel."

    async def reset_prefix_cache(self, request: gr.Request):
        self._check(request)
        try:
            await asyncio.to_thread(self.client.reset_prefix_cache)
        except (ValueError, EngineDeadError) as e:
            return f"❌ {e}"
        return "✅ Prefix cache reset: the next turn of every chat computes its prompt again."

    # ---- the weekly review of rated replies ------------------------------------------------
    def feedback_table(self, request: gr.Request):
        self._check(request)
        rows = transfer.feedback_rows(self.store.rated_replies())
        return [[r["feedback_at"], r["rating"], r["comment"], r["user_id"], r["title"], r["reply"]] for r in rows]
