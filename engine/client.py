"""The one front every caller of a running engine uses: the HTTP server, the chat UI, the
benchmarks. Two implementations: `engine.async_llm.AsyncLLM` (the engine in this process) and
`server.remote.RemoteLLM` (engine pods behind the OpenAI API). Tests use fakes of it.

Nothing here imports torch: a UI tier that talks to remote engines never loads it.

Threading rule for implementations: every method may be called from any thread; `generate` from
any event loop. `info` is immutable once the model is loaded; its tokenizer is shared read-only
(encode, decode, apply_chat_template), never reconfigured.
"""
from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine.errors import ParameterError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine is loading, crashed, or not reachable; nothing can be served (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; try again later (HTTP 503)."""


class ContextLengthError(ParameterError):
    """A prompt (and the tokens asked for) does not fit max_model_len. `parameter`: "prompt" or "max_tokens"."""


class BlockState(enum.IntEnum):
    """A KV block's state in `snapshot()["block_states"]`."""
    FREE = 0
    CACHED = 1  # free, its prefix hash kept: a later prompt may reuse it
    USED = 2
    SHARED = 3  # in use by more than one request


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model, fixed until the next switch."""
    name: str  # served model name
    model: str | None  # what was asked for: a path, a hub id, or None for the embedded default
    tokenizer: Any  # a transformers tokenizer with the model's chat template
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    quantization: str
    sampling_defaults: dict = field(default_factory=dict)  # the model's own (vLLM: generation config)
    sampling_source: str = "pagedchat's defaults"  # where sampling_defaults come from, in words
    block_size: int = 16  # tokens per KV block (prompt layouts align to it: ui/grounding.py)
    prefix_caching: bool = True  # a prompt's full blocks are kept for later prompts that share them

    def cache_writes(self, prompt_tokens: int, cached_tokens: int) -> int:
        """Prompt tokens a request added to the prefix cache: its full blocks past the cached ones."""
        return max(prompt_tokens // self.block_size * self.block_size - cached_tokens, 0) if self.prefix_caching else 0

    def default_sampling(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's defaults, then `overrides` (None values are ignored)."""
        values = {**self.sampling_defaults, **{k: v for k, v in overrides.items() if v is not None}}
        return SamplingParams(**values)


@runtime_checkable
class EngineClient(Protocol):
    state: str  # "loading" | "ready" | "dead"
    error: str | None  # why not ready, in words

    @property
    def ready(self) -> bool: ...

    @property
    def info(self) -> ModelInfo | None:
        """None until a model is loaded."""

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def generate(self, prompt: str | list[int], params: SamplingParams, *, request_id: str | None = None,
                 priority: int = 0, session_id: str | None = None,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """One RequestOutput per step with news; the last has finished=True. Refusals (bad input,
        ContextLengthError, EngineOverloadedError, EngineDeadError) raise at the first iteration.
        Leaving the loop early aborts the request. `session_id` groups one conversation's requests
        (the panel colours their pages; a remote client routes on it).
        Only requests with the same `cache_salt` share cached prefixes."""

    def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> dict | None:
        """What the live panel shows (stats, each block's BlockState and owner, memory), or None
        where the engine runs elsewhere."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (an operator's action); requests in flight go on."""

    def metrics_text(self) -> bytes:
        """Prometheus exposition of the engine's metrics (empty where there are none)."""

    def quantization_choices(self, model: str | None) -> list[str]:
        """What an operator may pick for `model`; the first is its default."""

    def switch_model(self, model: str | None, quantization: str | None) -> str:
        """Load another model (blocking the caller, never the others: the old model serves while it
        loads and finishes the replies in flight); a failed load leaves the old one serving and raises
        ValueError. Returns a line saying what happened."""

    def shutdown(self) -> None: ...
