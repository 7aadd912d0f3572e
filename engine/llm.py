"""The offline API shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams


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
             priority: list[int] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, priority=priority)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **(chat_template_kwargs or {}))
        return tok.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - done.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()
