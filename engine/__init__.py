"""pagedchat's inference engine: paged KV cache, prefix caching, continuous batching."""
import os

# Idle OpenMP threads must sleep, not spin: with spinning threads and another busy process on a
# 2-core machine one matmul ran 30x slower. libgomp reads this when torch first loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import EngineOverloadedError, LLMEngine  # noqa: E402
from engine.outputs import CompletionOutput, EngineStats, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineStats", "EngineOverloadedError"]
