"""Errors name their field where they are raised (engine.errors.ParameterError), and the server
answers OpenAI's `param` from that, whatever the message says."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import ParameterError, parameter_of
from engine.sampling_params import SamplingParams
from server.protocol import ChatCompletionRequest, CompletionRequest

BAD_SAMPLING = [("n", 0), ("temperature", -1), ("top_p", 0), ("top_k", -5), ("min_p", 2), ("max_tokens", 0),
                ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 2**70),
                ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -3), ("logprobs", 99),
                ("prompt_logprobs", -1), ("logit_bias", {1: float("inf")}), ("allowed_token_ids", []),
                ("bad_words", [" "])]


@pytest.mark.parametrize("name, value", BAD_SAMPLING)
def test_sampling_errors_name_their_field(name, value):
    with pytest.raises(ParameterError) as e:
        SamplingParams(**{name: value})
    assert e.value.parameter == name


def test_structured_and_min_tokens_errors_name_their_field():
    cases = [({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"structured_outputs": {"choice": [""]}}, "structured_outputs.choice"),
             ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
             ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]
    for kwargs, parameter in cases:
        with pytest.raises(ParameterError) as e:
            SamplingParams(**kwargs)
        assert parameter_of(e.value) == parameter


def test_protocol_errors_name_their_field():
    cases = [(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=3), "top_logprobs"),
             (CompletionRequest(prompt="x", logit_bias={"abc": 1}), "logit_bias"),
             (CompletionRequest(prompt="x", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
              "response_format"),
             (CompletionRequest(prompt="x", structured_outputs={"pattern": "a"}), "structured_outputs")]
    for request, parameter in cases:
        with pytest.raises(ParameterError) as e:
            request.sampling_params(room=10, defaults={})
        assert e.value.parameter == parameter


@pytest.mark.parametrize("name, value", [("block_size", 8), ("max_num_seqs", 0), ("dtype", "int3"),
                                         ("scheduling_policy", "lifo"), ("num_kv_blocks", 1)])
def test_config_errors_name_their_field(name, value):
    with pytest.raises(ParameterError) as e:
        EngineConfig(**{name: value})
    assert e.value.parameter == name


def test_the_server_takes_param_from_the_error_not_its_wording(smol_tokenizer):
    """A message that starts with another word still answers the raising field's name."""
    from fastapi.testclient import TestClient

    from server.routes import create_app
    from tests.fakes import FakeEngineClient

    fake = FakeEngineClient(smol_tokenizer)
    fake.refuse_with = ParameterError("Please pick a smaller value for this one.", "repetition_penalty")
    with TestClient(create_app(fake)) as client:
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "repetition_penalty"
