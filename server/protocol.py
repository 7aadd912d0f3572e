"""OpenAI request shapes (pydantic), and the mapping of request fields onto SamplingParams, which
validates their values (once, for every front). Nothing here touches the engine; the answers' shapes
are in server/replies.py."""
from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import ParameterError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tools import ToolPlan, parse_tools


class TextPart(BaseModel):
    """A content part. Only text is read: another kind (image_url, input_audio, file) is refused by name."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"this model reads text only; a content part of type {self.type!r} cannot be read")
        if self.text is None:
            raise ValueError("a text part needs its text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs its content (only an assistant's tool calls may stand "
                             "without it)")
        return self

    def as_dict(self) -> dict:
        """What the chat template and engine/tools.py read."""
        out = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields this server does not implement yet, with the values that ask for nothing: anything
# else is refused by name rather than silently ignored.
NOT_IMPLEMENTED = {"functions": (None, []),
                   "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1),
                   "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
                   "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
                   "reasoning_effort": (None,)}


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name": ..., "schema": {...}, "strict": ...}

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ParameterError("response_format with type json_schema needs json_schema.schema, a JSON schema "
                                     "object.", "response_format")
            return StructuredOutputsParams(json=schema)
        return None


class UnicodeBody(BaseModel):
    """A request body whose every string is Unicode text: JSON may carry a lone UTF-16 surrogate
    ("\\ud800"), which no tokenizer can encode; refused here with where it is."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        def check(value, where: str) -> None:
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ParameterError("not valid Unicode text (it holds a lone UTF-16 surrogate, such as "
                                         "\\ud800, without its pair)", where or None) from None
            elif isinstance(value, dict):
                for k, v in value.items():
                    check(k, where)
                    check(v, f"{where}.{k}" if where else str(k))
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    check(v, f"{where}[{i}]")
        check(body, "")
        return body


class SamplingFields(UnicodeBody):
    """Fields shared by /v1/chat/completions and /v1/completions. Unknown fields are kept and checked
    against NOT_IMPLEMENTED; others (OpenAI's `metadata`, `store`, ...) are ignored."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    # vLLM's: mixed into the hash of the prompt's first block, so only requests with the same salt share
    # cached prefixes (tenants that must not learn from each other's timing).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | ...
    prompt_logprobs: int | None = None  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    return_token_ids: bool = False  # extension (as in vLLM): each choice / chunk carries its token ids

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sample_logprobs(self) -> int | None:
        """How many top log probabilities per generated token (None: none at all)."""
        return None

    def structured(self) -> StructuredOutputsParams | None:
        if self.response_format is not None and self.structured_outputs is not None:
            raise ParameterError("response_format and structured_outputs cannot both be given; pick one.",
                                 "response_format")
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                raise ParameterError("structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                                     f"{sorted(self.structured_outputs)}.", "structured_outputs") from None
        return self.response_format.structured() if self.response_format else None

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ParameterError("logit_bias keys must be token ids, e.g. {\"1234\": -100}.", "logit_bias") from None

    def not_implemented(self) -> str | None:
        """The first field that asks for something this server does not do yet."""
        extra = self.model_extra or {}
        return next((name for name, neutral in NOT_IMPLEMENTED.items()
                     if name in extra and extra[name] not in neutral), None)

    def sampling_params(self, room: int, defaults: dict) -> SamplingParams:
        """`room`: tokens left in the context after the prompt (the default for max_tokens);
        `defaults`: the model's own sampling defaults, for fields the request leaves out (as vLLM)."""
        wanted = self.requested_max_tokens()
        values = dict(n=self.n, max_tokens=room if wanted is None else wanted, min_tokens=self.min_tokens,
                      stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed, ignore_eos=self.ignore_eos,
                      logprobs=self.sample_logprobs(), prompt_logprobs=self.prompt_logprobs,
                      logit_bias=self.token_bias(), allowed_token_ids=self.allowed_token_ids,
                      bad_words=self.bad_words, structured_outputs=self.structured(),
                      skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            values[name] = defaults.get(name, default) if value is None else value
        return SamplingParams(**values)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat-template switches: continue the last (assistant) message instead of opening a new one
    # (a prefill: "Your order NW"), and the template's own keyword arguments.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def template_options(self) -> dict:
        """The chat template's keyword arguments for this request (ParameterError where they conflict)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ParameterError("continue_final_message needs add_generation_prompt: false (a reply either "
                                 "continues the last message or opens a new one).", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParameterError("continue_final_message continues the last message, which must be the "
                                 "assistant's.", "continue_final_message")
        kwargs = self.chat_template_kwargs or {}
        taken = sorted(set(kwargs) & {"add_generation_prompt", "continue_final_message", "tools", "messages",
                                       "conversation", "tokenize", "documents"})
        if taken:
            raise ParameterError(f"chat_template_kwargs may not set {', '.join(taken)}.", "chat_template_kwargs")
        return {**kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @functools.cached_property
    def tool_plan(self) -> ToolPlan | None:
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutputsParams | None:
        plan, other = self.tool_plan, super().structured()
        if plan is None or plan.grammar is None:
            return other
        if other is not None:
            raise ParameterError("tools and response_format / structured_outputs cannot be combined; pick one "
                                 "(or tool_choice \"none\").", "tools")
        return StructuredOutputsParams(grammar=plan.grammar)

    def sample_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs needs logprobs: true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, room: int, defaults: dict) -> SamplingParams:
        params = super().sampling_params(room, defaults)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # echo with logprobs scores the prompt too
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TokenizeRequest(UnicodeBody):
    """vLLM's /tokenize: a prompt, or messages rendered as /v1/chat/completions would render them (with
    the same template switches and tools), so the count is the one a chat request would use."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    tools: list | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False

    def as_chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=self.messages, tools=self.tools,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
