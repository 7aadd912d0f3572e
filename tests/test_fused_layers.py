"""The decoder stack as one C call (engine/fused_layers.py, csrc/decoder.c): the same bits as the modules
one by one, for every kind of packed linear, int8 KV, biases, Qwen3's q/k norms, drafts, prompt rows and
the cascade; the models and steps it does not serve run their modules."""
import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.quant import cpu_matmul
from engine.attention import AttentionMetadata, PrefillSeq
from engine.fused_layers import FusedLayers
from engine.linear import Linear
from tests.kquants import q4_k_m_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")]
BF16 = torch.bfloat16 in cpu_matmul.quant_matmul_dtypes()
F32 = torch.float32 in cpu_matmul.quant_matmul_dtypes()
# long enough that prompt chunks and decodes share steps (max_num_batched_tokens 32), repetitive enough
# that prompt lookup drafts tokens
PROMPTS = ["order 4417 order 4417 order 4417 where is order 4417 " * 3, "hello", "a b c d e f g a b c d e f g",
           "refund policy: thirty days, receipt needed. refund policy: thirty days, receipt needed."]


def counted(monkeypatch) -> list[int]:
    """The rows of each decoder_layers call from now on, negative where it ran a cascade."""
    calls, real = [], cpu_kernels.decoder_layers

    def count(table, shape, h, *args):
        calls.append(-h.shape[0] if args[-1] is not None else h.shape[0])
        return real(table, shape, h, *args)
    monkeypatch.setattr(cpu_kernels, "decoder_layers", count)
    return calls


def fused_and_modules(llm: LLM, monkeypatch, prompts: list[str] = PROMPTS,
                      prompt_logprobs: int | None = 2) -> tuple[list, list, list[int]]:
    """Greedy replies with their logprobs and prompt logprobs, through the fused stack and through the
    modules (the same engine, nothing cached between but the first prompt, run alone first), and the
    fused run's decoder_layers calls. Prompt logprobs compute every prompt token (no prefix cache)."""
    model = llm.engine.model.model
    fused, results, calls = model.fused, [], counted(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=prompt_logprobs)
    for stack in (fused, None):
        model.fused = stack
        llm.reset_prefix_cache()
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs])
        if stack is not None:
            fused_calls = list(calls)
    model.fused = fused
    assert len(calls) == len(fused_calls)  # the modules' run made none
    return results[0], results[1], fused_calls


CASES = [  # arch, dtype, quantization, kv cache, int8 activations
    pytest.param("llama", "bfloat16", "int4", "auto", True, marks=pytest.mark.skipif(not BF16, reason="no bf16 kernels")),
    pytest.param("llama", "bfloat16", "int4", "int8", False, marks=pytest.mark.skipif(not BF16, reason="no bf16 kernels")),
    pytest.param("qwen2", "bfloat16", "int8", "auto", True, marks=pytest.mark.skipif(not BF16, reason="no bf16 kernels")),
    pytest.param("qwen2", "float32", "int4", "int8", True, marks=pytest.mark.skipif(not F32, reason="no fp32 kernels")),
    pytest.param("qwen3", "bfloat16", "int4", "int8", True, marks=pytest.mark.skipif(not BF16, reason="no bf16 kernels")),
    pytest.param("qwen3", "float32", "int8", "auto", True, marks=pytest.mark.skipif(not F32, reason="no fp32 kernels")),
    pytest.param("llama", "float32", "int8", "auto", False, marks=pytest.mark.skipif(not F32, reason="no fp32 kernels")),
]


@pytest.mark.parametrize("arch,dtype,quantization,kv,int8_rows", CASES)
def test_the_fused_stack_computes_the_modules_bits(arch, dtype, quantization, kv, int8_rows, tiny_model, monkeypatch):
    llm = LLM(tiny_model(arch)[0], dtype=dtype, quantization=quantization, kv_cache_dtype=kv,
              int8_activations=int8_rows, max_num_batched_tokens=32, num_kv_blocks=256)
    assert llm.engine.model.model.fused is not None
    biases = [m.bias for m in llm.engine.model.modules() if isinstance(m, Linear) and m.bias is not None]
    assert bool(biases) == (arch == "qwen2")
    qk_norms = [n.weight for m in llm.engine.model.model.layers if m.self_attn.qk_norm
                for n in (m.self_attn.q_norm, m.self_attn.k_norm)]
    assert bool(qk_norms) == (arch == "qwen3")
    with torch.no_grad():  # the checkpoint's are zeros and ones: make them count
        for b in biases:
            b.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        gen = torch.Generator().manual_seed(1)
        for w in qk_norms:  # each its own
            w.normal_(1, 0.5, generator=gen)
    fused, modules, calls = fused_and_modules(llm, monkeypatch)
    assert fused == modules
    assert calls and max(calls) > 1  # batched rows went through it
    every_row = not llm.engine.model.model.fused.limits  # no dense copies: prompt rows and drafts too
    assert (max(calls) > len(PROMPTS)) == every_row


@pytest.mark.skipif(not BF16, reason="GGUF's 5- and 8-bit group kernels need AVX-512 BF16 and VNNI")
def test_a_q4_k_m_gguf_mixing_4_5_and_8_bit_layers(tmp_path, monkeypatch):
    from engine.quant.group_kernels import Int5Weight, Int8GroupWeight

    path = str(tmp_path / "smollm2-q4_k_m.gguf")
    q4_k_m_gguf(path)
    llm = LLM(path, max_num_batched_tokens=32, num_kv_blocks=256)
    kinds = {type(m.mlp.down_proj.kernel) for m in llm.engine.model.model.layers} | \
        {type(m.self_attn.qkv_proj.kernel) for m in llm.engine.model.model.layers}
    assert {Int5Weight, Int8GroupWeight} <= kinds
    fused, modules, calls = fused_and_modules(llm, monkeypatch)
    assert fused == modules and max(calls) > len(PROMPTS)


@pytest.mark.skipif(not cpu_kernels.has("bf16_attention"), reason="the cascade's prefix kernel needs AVX-512 BF16")
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_cascade_steps(kv, tmp_path, tokenizer_dir, monkeypatch):
    """Rows sharing a system prompt: the prefix attended once for all of them inside the call (a model
    with the prefix kernel's head size, 64), the same bits as the modules' cascade."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from engine import cascade

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(cascade, "MIN_SHARING_ROWS", 4)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS_KERNEL", 32)
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="int4", kv_cache_dtype=kv, num_kv_blocks=256,
              batch_invariant=False)
    system = "You are Sam of Northwind Outfitters. Refunds within thirty days with a receipt. " * 3
    prompts = [system + question for question in ("where is my order 4417?", "hello", "a b c d e f g a b c",
                                                  "can I return boots?", "what are your hours", "thanks")]
    fused, modules, calls = fused_and_modules(llm, monkeypatch, prompts, prompt_logprobs=None)
    assert fused == modules
    assert min(calls) <= -4  # steps of at least four sharing rows went through it with their cascade


@pytest.mark.parametrize("arch,quantization", [("mistral-window", "int4"), ("gemma3", "int4"), ("llama", "none")])
def test_models_it_does_not_serve_run_their_modules(arch, quantization, tiny_model):
    """A sliding window, Gemma's layers, dense weights: no fused stack, and replies as ever."""
    llm = LLM(tiny_model(arch)[0], quantization=quantization, num_kv_blocks=64)
    assert getattr(llm.engine.model.model, "fused", None) is None
    assert len(llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids) == 4


def test_the_knob_turns_it_off(tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_NO_FUSED_LAYERS", "1")
    assert LLM(tiny_model("llama")[0], quantization="int4", num_kv_blocks=64).engine.model.model.fused is None


def test_steps_it_does_not_serve(tiny_model):
    """A prompt chunk attended by SDPA, or rows a linear would give its dense copy."""
    llm = LLM(tiny_model("llama")[0], quantization="int8", num_kv_blocks=64)
    fused = llm.engine.model.model.fused
    (all_rows, small_m), = fused.limits
    h = torch.zeros(3, 64, dtype=fused.dtype)
    table, lens = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, dtype=torch.long)

    def meta(num_decode=3, rows=3, **kw):
        return AttentionMetadata(torch.arange(3), num_decode, table[:rows], lens[:rows], **kw)
    assert fused.serves(h, meta()) and not fused.serves(h, None)
    assert not fused.serves(h, meta(rows=2, prefills=[PrefillSeq(2, 1, 1, torch.zeros(1, dtype=torch.long))]))
    assert not fused.serves(h, meta(num_decode=2)) and all_rows < 3  # a prompt row would take the dense copy
    many = torch.zeros(small_m + 1, 64, dtype=fused.dtype)
    table, lens = torch.zeros(small_m + 1, 1, dtype=torch.long), torch.ones(small_m + 1, dtype=torch.long)
    assert not fused.serves(many, AttentionMetadata(torch.arange(small_m + 1), small_m + 1, table, lens))
    assert isinstance(fused, FusedLayers)
