"""The offline API shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import copy

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import ChoiceCollector, EngineStats, RequestOutput, ScheduledRequest
from engine.request import Request
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tool_calls import parse_reply
from engine.tools import ToolPlan, parse_tools, render


class LLM:
    """Runs the engine in the caller's thread until the given requests finish."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's own defaults (generation_config.json, else its card), as vLLM's LLM gives them."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        priority = priority or [0] * len(prompts)
        if len(params) != len(prompts) or len(priority) != len(prompts):
            raise ValueError("sampling_params and priority lists must match the prompts in length")
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(self.engine.add_request(prompt, p, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()  # flush the abort outputs
            raise
        return self._run(ids)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             priority: list[int] | None = None, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}, with "tool_calls" / "tool_call_id" where a
        tool was used) or a list of them. tools, tool_choice, parallel_tool_calls: OpenAI's; each
        output then carries `content` and `tool_calls` (engine/tools.py), its arguments valid by
        construction."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        plan = parse_tools(tools, tool_choice, parallel_tool_calls)
        prompts = [self.render_chat(c, add_generation_prompt, chat_template_kwargs, plan) for c in conversations]
        if plan is None or plan.grammar is None:
            return self.generate(prompts, sampling_params, priority=priority)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        params = [copy.copy(p or self.get_default_sampling_params()) for p in params]
        for p in params:
            p.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
        results = self.generate(prompts, params, priority=priority)
        for result in results:
            for out in result.outputs:
                out.content, out.tool_calls = parse_reply(out.text)
        return results

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None, tools: ToolPlan | None = None) -> list[int]:
        return render(self.engine.tokenizer, messages, tools, add_generation_prompt, **(chat_template_kwargs or {}))

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        collected = {i: ChoiceCollector() for i in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.request_id in collected:
                    collected[out.request_id].add(out)
                    if out.finished:
                        done.add(out.request_id)
        return [collected[i].whole() for i in ids]

    def mean_nll(self, token_ids: list[int]) -> float:
        """Mean negative log-likelihood of a token sequence under the model (quality checks), from
        one prefill through the paged cache; the engine must be idle."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("mean_nll needs an idle engine")
        req = Request("score", token_ids, SamplingParams())
        if not self.engine.kv.allocate_slots(req, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit the KV cache")
        try:
            logits = self.engine.runner.logits_for_all(ScheduledRequest(req, len(token_ids), self.engine.kv.block_ids("score")))
        finally:
            self.engine.kv.free(req)
        targets = torch.tensor(token_ids[1:], device=logits.device)
        return torch.nn.functional.cross_entropy(logits[:-1].float(), targets).item()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()
