"""CUDA checks of the engine on a tiny random Llama (with SmolLM2's tokenizer): parity with
transformers, logprobs, n > 1 forks, structured outputs, masks, prefix cache, the KV disk tier,
bf16 and int4.
Prints one JSON (and writes it to $OUT). Not a test: CI has no GPU. To run it on a lent GPU
machine, prepare here (the image there has torch and transformers, not gguf or llguidance):

    mkdir -p .devcheck/whl && echo /.devcheck/ >> .git/info/exclude
    .venv/bin/pip download --no-deps gguf==0.19.0 -d .devcheck/whl
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_31_x86_64 llguidance==1.9.1 -d .devcheck/whl
    .venv/bin/python -c "from engine.checkpoint.source import default_model_path as p, \
        gguf_config_and_tokenizer as g; g(p())[1].save_pretrained('.devcheck/tokenizer')"

then, there, carrying .devcheck: install the wheels into /tmp/site, PYTHONPATH=/tmp/site, and
`python3 -m bench.cuda_checks`."""
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, ".")
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.sampling_params import StructuredOutputsParams  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}


def check(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001
            results[name] = f"FAIL {type(e).__name__}: {e} | {traceback.format_exc()[-600:]}"
        results[name + "_s"] = round(time.perf_counter() - t0, 2)
        print(name, results[name], flush=True)
    return wrap


tok = AutoTokenizer.from_pretrained(os.environ.get("TOKENIZER", ".devcheck/tokenizer"))
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                  tie_word_embeddings=False)
torch.manual_seed(0)
hf = AutoModelForCausalLM.from_config(cfg)
for p in hf.parameters():
    if p.dim() == 2:
        torch.nn.init.normal_(p, std=0.2)
PATH = "/tmp/tiny-llama"
hf.save_pretrained(PATH)
tok.save_pretrained(PATH)
hf = hf.float().cuda().eval()
g = torch.Generator().manual_seed(1)
PROMPT = [int(t) for t in torch.randint(0, len(tok), (45,), generator=g)]
llm = LLM(PATH, device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=1024)


def hf_logprobs(ids):
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)


@check("greedy_equals_transformers_fp32")
def _():
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5))[0]
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT], device="cuda"), attention_mask=torch.ones(1, len(PROMPT), device="cuda",
                          dtype=torch.long), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    lp = hf_logprobs(PROMPT + ids)
    err = max(abs(e[t].logprob - lp[len(PROMPT) - 1 + i, t].item()) for i, (t, e) in
              enumerate(zip(ids, out.outputs[0].logprobs)))
    return {"equal": ids == ref, "max_logprob_err": err}


@check("prompt_logprobs_nll")
def _():
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    ours = -sum(e[t].logprob for e, t in zip(out.prompt_logprobs[1:], PROMPT[1:])) / (len(PROMPT) - 1)
    lp = hf_logprobs(PROMPT)
    ref = -lp[:-1].gather(1, torch.tensor(PROMPT[1:], device="cuda").unsqueeze(1)).mean().item()
    return {"ours": ours, "ref": ref, "ok": abs(ours - ref) < 1e-3}


@check("n4_fork_equals_separate_and_shares_blocks")
def _():
    nocache = LLM(PATH, device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=1024,
                  enable_prefix_caching=False)
    eng = nocache.engine
    rid = eng.add_request(PROMPT, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))
    eng.step()
    used = eng.get_stats().kv_blocks_used
    together = [c.token_ids for c in nocache._run([rid])[0].outputs]
    apart = [o.outputs[0].token_ids for o in nocache.generate(
        [PROMPT] * 4, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True) for i in range(4)])]
    eng.check_integrity()
    return {"used_after_fork": used, "expected": (len(PROMPT) - 1) // 16 + 4, "equal": together == apart,
            "left": eng.get_stats().kv_blocks_used}


@check("structured_and_masks_on_cuda")
def _():
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].outputs[0].token_ids
    regex = SamplingParams(temperature=0.8, seed=2, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"NW[0-9]{8}"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    js = SamplingParams(temperature=0.8, seed=3, max_tokens=400, structured_outputs=StructuredOutputsParams(json=schema))
    outs = llm.generate([PROMPT, PROMPT[:20], PROMPT[:30]], [free, regex, js])
    import re
    done = outs[2].outputs[0].finish_reason == "stop"
    parsed = json.loads(outs[2].outputs[0].text) if done else {}
    forced = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logit_bias={77: 100}))[0]
    allowed = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=1, max_tokens=8, allowed_token_ids=[5, 6, 7]))[0]
    return {"free_unchanged": outs[0].outputs[0].token_ids == alone,
            "regex_ok": bool(re.fullmatch(r"NW[0-9]{8}", outs[1].outputs[0].text)),
            "json_ok": set(parsed) == {"a", "b"} and parsed["b"] in ("x", "y") if done else
            f"cut at max_tokens: {outs[2].outputs[0].text[:80]!r}",
            "bias_ok": forced.outputs[0].token_ids == [77] * 3,
            "allowed_ok": set(allowed.outputs[0].token_ids) <= {5, 6, 7}}


@check("prefix_cache_hit_on_cuda")
def _():
    a = llm.generate([PROMPT + [3] * 40], SamplingParams(temperature=0, max_tokens=4))[0]
    b = llm.generate([PROMPT + [3] * 40], SamplingParams(temperature=0, max_tokens=4))[0]
    return {"cached_second": b.num_cached_tokens, "same": a.outputs[0].token_ids == b.outputs[0].token_ids}


@check("kv_disk_tier_on_cuda")
def _():
    """Blocks written from GPU memory, a restarted engine reads them back into it, same greedy output;
    in bf16, where the bytes loaded must equal the bytes a pool hit would have used."""
    import tempfile

    folder, got = tempfile.mkdtemp(), {}
    for dtype in ("float32", "bfloat16"):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        first = LLM(PATH, device="cuda", dtype=dtype, num_kv_blocks=256, max_model_len=1024, kv_disk=folder)
        a = first.generate([PROMPT * 4], params)[0]
        history = PROMPT * 4 + a.outputs[0].token_ids + [5, 6, 7]
        pool_hit = first.generate([history], params)[0]
        first.engine.close()
        again = LLM(PATH, device="cuda", dtype=dtype, num_kv_blocks=256, max_model_len=1024, kv_disk=folder)
        back = again.generate([history], params)[0]
        again.engine.close()
        got[dtype] = {"cached_after_restart": back.num_cached_tokens, "pool_hit_cached": pool_hit.num_cached_tokens,
                      "same_as_pool_hit": back.outputs[0].token_ids == pool_hit.outputs[0].token_ids,
                      "disk_hits": again.get_stats().kv_disk_hits}
    return got


@check("bf16_and_int4")
def _():
    bf16 = LLM(PATH, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=1024)
    int4 = LLM(PATH, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=1024, quantization="int4")
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    got = {}
    for name, m in (("bf16", bf16), ("int4", int4)):
        ids = m.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
        got[name] = {"agree_with_fp32": sum(x == y for x, y in zip(ids, ref)) / 16, "nll": m.mean_nll(PROMPT),
                     "quantization": m.engine.quantization}
    got["fp32_nll"] = llm.mean_nll(PROMPT)
    return got


@check("batch64_decode_steps")
def _():
    big = LLM(PATH, device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_model_len=1024, max_num_seqs=64)
    t0 = time.perf_counter()
    outs = big.generate([PROMPT] * 64, SamplingParams(temperature=1.0, seed=1, max_tokens=64, ignore_eos=True))
    dt = time.perf_counter() - t0
    return {"tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / dt, 1),
            "left": big.engine.get_stats().kv_blocks_used}


with open(os.path.join(OUT, "cuda_checks.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
print(json.dumps(results, default=str))
