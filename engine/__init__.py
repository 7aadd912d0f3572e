"""pagedchat's inference engine: paged KV cache, prefix caching, continuous batching.

Names load lazily, so `engine.client` (the front the server and UI use) imports no torch."""
import importlib
import os

# Idle OpenMP threads must sleep, not spin: with spinning threads and another busy process on a
# 2-core machine one matmul ran 30x slower. libgomp reads this when torch first loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"  # the server's GET /version and FastAPI's title page say it

_EXPORTS = {
    "LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "AsyncLLM": "engine.async_llm",
    "EngineConfig": "engine.config", "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs", "EngineStats": "engine.outputs",
    "EngineClient": "engine.client", "EngineDeadError": "engine.client", "EngineOverloadedError": "engine.client",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
