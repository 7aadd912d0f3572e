"""The engines of one deployment, by the model an assistant names.

The main engine is the one the server starts with: the API, the demo page, the live panel and the
operator's model switcher act on it, and assistants that name no model (or the main one) chat with
it. An assistant may name another of the models the deployment offers (`--models`); that model gets
an engine of its own, loaded in the background the first time a chat or an operator needs it, with
the main engine's settings. In-process engines share the CPU one step at a time (engine.cpu_turns).

Nothing here imports torch (the UI tier builds a fleet of one remote engine)."""
from __future__ import annotations

import threading
from collections.abc import Callable

from engine.client import EngineClient


class ModelFleet:
    def __init__(self, main: EngineClient, offered: dict[str, str | None],
                 start: Callable[[str | None], EngineClient] | None = None) -> None:
        """offered: label -> model argument (a path, a hub id, None for the embedded default), the
        first being the main engine's. start(model) makes another engine; None: the main one only
        (a UI tier on remote engines)."""
        self.main, self.offered, self._start = main, offered, start
        self.main_label = next(iter(offered))
        self._others: dict[str, EngineClient] = {}
        self._lock = threading.Lock()

    def choices(self) -> list[str]:
        """What an assistant may name: "" (the main model) and each offered model's label."""
        return ["", *self.offered] if self._start else ["", self.main_label]

    def check(self, model: str) -> None:
        """ValueError unless an assistant may name `model`."""
        if model and model not in self.choices():
            offered = ", ".join(repr(m) for m in self.choices() if m)
            raise ValueError(f"this deployment does not offer the model {model!r}; it offers {offered} (add others "
                             f"with --models), or leave it empty for the main model")

    def client_for(self, model: str | None) -> EngineClient:
        """The engine for an assistant's model, started if it is not yet. A name no longer offered
        (a model dropped from --models since the assistant was saved) is answered by the main model."""
        if not model or model == self.main_label or model not in self.offered or self._start is None:
            return self.main
        with self._lock:
            if model not in self._others:
                self._others[model] = self._start(self.offered[model])
            return self._others[model]

    def others(self) -> dict[str, EngineClient]:
        """The engines started besides the main one, by label."""
        with self._lock:
            return dict(self._others)

    def problems(self) -> str | None:
        """Why an assistant's own model cannot answer (its load failed, its engine died), for /health."""
        dead = [f"{label}: {client.error or 'not serving'}" for label, client in self.others().items()
                if client.state == "dead"]
        return "; ".join(dead) or None

    def every(self) -> list[EngineClient]:
        return [self.main, *self.others().values()]

    def drain(self, grace_s: float) -> None:
        """SIGTERM: every engine stops admitting and ends its replies within the grace time, together."""
        drains = [threading.Thread(target=c.drain, args=(grace_s,)) for c in self.every() if hasattr(c, "drain")]
        for t in drains:
            t.start()
        for t in drains:
            t.join()

    def shutdown(self) -> None:
        for client in self.every():
            client.shutdown()
