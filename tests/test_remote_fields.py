"""The UI tier's RemoteLLM forwards every sampling field to the engine pods: what it sends, parsed
by the pods' own protocol, gives back the SamplingParams it was given."""
from __future__ import annotations

import dataclasses

import pytest

from engine.sampling_params import SamplingParams
from server.protocol import CompletionRequest
from server.remote import NOT_FORWARDED, completion_fields

# Every SamplingParams field away from its default (NOT_FORWARDED ones aside).
CHANGED = dict(temperature=0.7, top_p=0.8, top_k=12, min_p=0.05, max_tokens=33, min_tokens=2, stop=["END"],
               stop_token_ids=[7, 9], ignore_eos=True, seed=1234, repetition_penalty=1.1, presence_penalty=0.3,
               frequency_penalty=-0.2, skip_special_tokens=False, include_stop_str_in_output=True,
               logit_bias={5: 2.5}, allowed_token_ids=[3, 4, 5, 7, 9], bad_words=["refund"],
               structured_outputs={"regex": "[a-z]+"})


def init_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def test_the_test_changes_every_field_that_is_forwarded():
    assert set(CHANGED) == set(init_fields()) - set(NOT_FORWARDED), \
        "a SamplingParams field was added: give it a value in CHANGED (or a reason in NOT_FORWARDED)"


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_each_sampling_field_reaches_the_engine_pod(name):
    sent = SamplingParams(**CHANGED)
    received = CompletionRequest(prompt=[1, 2, 3], **completion_fields(sent)).sampling_params(room=100, defaults={})
    assert getattr(received, name) == getattr(sent, name)
    assert getattr(received, name) != getattr(SamplingParams(), name)  # a default would pass unseen


def test_model_defaults_do_not_override_what_was_sent():
    sent = SamplingParams(temperature=0.9, top_p=0.5)
    received = CompletionRequest(prompt=[1], **completion_fields(sent)).sampling_params(
        room=100, defaults={"temperature": 0.2, "top_p": 0.9})
    assert (received.temperature, received.top_p) == (0.9, 0.5)
