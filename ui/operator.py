"""The operator's controls: which model and quantization serve, and simulated customers. The
engine decides what applies (EngineClient.quantization_choices / switch_model); this only asks."""
from __future__ import annotations

import asyncio

import gradio as gr

from engine.client import EngineClient
from ui.simulate import start_simulated_chats


class OperatorHandlers:
    def __init__(self, client: EngineClient, models: dict[str, str | None], quantization: str | None) -> None:
        """models: label -> model argument (None = the embedded default), the first loaded at start
        with `quantization` (None: its default)."""
        self.client = client
        self.models = models
        self.quantization = quantization

    def initial_choices(self) -> tuple[list[str], str | None]:
        """Quantization choices of the starting model, and the one in force."""
        choices = self.client.quantization_choices(next(iter(self.models.values())))
        in_force = self.quantization if self.quantization in choices else (choices[0] if choices else None)
        return choices, in_force

    def quant_options(self, label: str):
        choices = self.client.quantization_choices(self.models[label])
        return gr.update(choices=choices, value=choices[0] if choices else None)

    async def switch(self, label: str, quant: str):
        serving = self.client.info.name if self.client.info else "the current model"
        yield f"Loading **{label}** ({quant})… in-flight requests will be aborted."
        try:
            result = await asyncio.to_thread(self.client.switch_model, self.models[label], quant)
        except ValueError as e:
            yield f"❌ {e}. Still serving **{serving}**."
            return
        yield f"✅ {result}. Sessions keep their history; their next turn re-reads it once."

    async def simulate(self, n):
        if not self.client.ready:
            return "The engine is not ready yet."
        started = start_simulated_chats(self.client, int(n or 16))
        return f"Started {started} simulated chats (3 turns each, then they stop). Watch the panel."
