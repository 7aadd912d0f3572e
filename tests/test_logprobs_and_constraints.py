"""Log probabilities and constrained sampling on the real model: logprobs against transformers' own
log_softmax, prompt logprobs against a reference NLL, logit_bias / allowed_token_ids / bad_words,
and structured outputs (JSON schema, regex, choice) sharing a batch with free requests."""
import json
import re

import pytest
import torch

from engine import SamplingParams
from engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.e2e

PASSAGE = ("Orders ship within two business days from our warehouse in Denver. Standard shipping takes three "
           "to five business days and is free for orders over fifty dollars.")
ORDER_SCHEMA = {
    "type": "object",
    "properties": {"order_number": {"type": "string", "pattern": "^NW[0-9]{8}$"},
                   "product": {"type": "string", "maxLength": 40},
                   "intent": {"type": "string", "enum": ["refund", "exchange", "delivery status", "complaint"]}},
    "required": ["order_number", "product", "intent"], "additionalProperties": False}


def reference_logprobs(hf_smol, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_smol(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_greedy_logprobs_are_transformers_log_softmax(smol32, hf_smol):
    prompt = smol32.render_chat([{"role": "user", "content": "Where is my parcel?"}])
    out = smol32.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))[0]
    completion = out.outputs[0]
    ref = reference_logprobs(hf_smol, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert entry[token].rank == 1 and abs(entry[token].logprob - row[token].item()) < 1e-3
        assert set(entry) == set(row.topk(5).indices.tolist())  # greedy: the chosen token is the top one
        assert entry[token].decoded_token == smol32.get_tokenizer().decode([token])
    assert out.prompt_logprobs is None  # not asked, not computed


def test_prompt_logprobs_give_the_reference_nll_even_after_a_cache_hit(smol32, hf_smol):
    ids = smol32.get_tokenizer().encode(PASSAGE)
    ref = reference_logprobs(hf_smol, ids)
    expected = -ref[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    for _ in range(2):  # the second run's prompt is in the prefix cache; its logprobs are computed anyway
        out = smol32.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
        scores = out.prompt_logprobs
        assert scores[0] is None and len(scores) == len(ids)
        nll = -sum(entry[t].logprob for entry, t in zip(scores[1:], ids[1:])) / (len(ids) - 1)
        assert abs(nll - expected) < 1e-3
        assert all(len(entry) <= 3 for entry in scores[1:])  # the prompt token and the top 2


def test_sampled_logprobs_rank_the_chosen_token(smol32):
    prompt = smol32.get_tokenizer().encode("Our support hours are")
    out = smol32.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True,
                                                   logprobs=0))[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert list(entry) == [token] and entry[token].rank >= 1 and entry[token].logprob <= 0


def test_logit_bias_allowed_tokens_and_bad_words(smol32):
    tok = smol32.get_tokenizer()
    prompt = smol32.render_chat([{"role": "user", "content": "Say hello to me in one sentence."}])
    free = smol32.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    forced = tok.encode(" parcel", add_special_tokens=False)[0]
    biased = smol32.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100}))[0]
    assert biased.outputs[0].token_ids == [forced] * 4
    avoided = smol32.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                       logit_bias={free.token_ids[0]: -100}))[0]
    assert avoided.outputs[0].token_ids[0] != free.token_ids[0]
    allowed = tok.encode(" yes no maybe", add_special_tokens=False)
    only = smol32.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                    allowed_token_ids=allowed))[0]
    assert set(only.outputs[0].token_ids) <= set(allowed)
    word = next(w for w in re.findall(r"[A-Za-z]{4,}", free.text))
    banned = smol32.generate([prompt], SamplingParams(temperature=0, max_tokens=16, bad_words=[word]))[0]
    assert word not in banned.outputs[0].text and banned.outputs[0].text != free.text


def check_order(text: str) -> dict:
    data = json.loads(text)
    assert set(data) == set(ORDER_SCHEMA["required"]), data
    assert re.fullmatch(r"NW[0-9]{8}", data["order_number"]) and len(data["product"]) <= 40
    assert data["intent"] in ORDER_SCHEMA["properties"]["intent"]["enum"]
    return data


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extracting_an_order_as_json_always_validates(smol32, seed):
    """The customer-service use: extract order number, product and intent, sampled, on the default model."""
    messages = [{"role": "system", "content": "Extract the order number, the product and the customer's intent "
                                              "as JSON."},
                {"role": "user", "content": "Hi, my order NW20481377 with the blue hiking backpack arrived with "
                                            "a broken zipper. I want my money back."}]
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA))
    out = smol32.generate([smol32.render_chat(messages)], params)[0].outputs[0]
    assert out.finish_reason == "stop", out
    check_order(out.text)


def test_constrained_and_free_requests_share_a_step(smol32):
    free_prompt = smol32.render_chat([{"role": "user", "content": "What are your opening hours?"}])
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = smol32.generate([free_prompt], greedy)[0].outputs[0].token_ids
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["refund", "exchange", "status"]))
    regex = SamplingParams(temperature=0.7, seed=1, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"NW[0-9]{8}"))
    outs = smol32.generate([free_prompt, smol32.render_chat([{"role": "user", "content": "I want my money back"}]),
                            smol32.render_chat([{"role": "user", "content": "Make up an order number"}])],
                           [greedy, choice, regex])
    assert outs[0].outputs[0].token_ids == alone  # the masks touched only their own rows
    assert outs[1].outputs[0].text in ("refund", "exchange", "status")
    assert re.fullmatch(r"NW[0-9]{8}", outs[2].outputs[0].text)
    smol32.engine.check_integrity()


@pytest.mark.parametrize("params, complaint", [
    (dict(structured_outputs=StructuredOutputsParams(regex="[0-9+")), "invalid regex"),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "bogus"})), "bogus"),
    (dict(logit_bias={10 ** 7: 1.0}), "vocabulary size"),
    (dict(allowed_token_ids=[10 ** 7]), "vocabulary size"),
])
def test_bad_constraints_are_refused_at_admission(smol32, params, complaint):
    with pytest.raises(ValueError, match=complaint):
        smol32.engine.add_request([1, 2, 3], SamplingParams(**params))
    assert not smol32.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, complaint", [
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"), (dict(structured_outputs={}), "exactly one"),
    (dict(structured_outputs={"json": "{not json"}), "not valid JSON"),
    (dict(structured_outputs={"choice": []}), "exactly one"),
])
def test_sampling_params_refuse_bad_values(fields, complaint):
    with pytest.raises(ValueError, match=complaint):
        SamplingParams(**fields)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(hf_smol):
    from engine import LLM

    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=128, max_model_len=1024,
              logprobs_mode="processed_logprobs")
    prompt = llm.get_tokenizer().encode("Our support hours are")
    bias = {11: 3.0, 314: -2.0}
    out = llm.generate([prompt], SamplingParams(temperature=2.0, seed=4, max_tokens=6, ignore_eos=True, logprobs=2,
                                                logit_bias=bias))[0].outputs[0]
    with torch.no_grad():
        raw = hf_smol(torch.tensor([prompt + out.token_ids])).logits[0].float()
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = raw[len(prompt) - 1 + step].clone()
        for t, b in bias.items():
            row[t] += b
        expected = (row / 2.0).log_softmax(-1)
        assert abs(entry[token].logprob - expected[token].item()) < 1e-3
