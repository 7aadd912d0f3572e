import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import LLM  # noqa: E402
from engine.checkpoint.gguf import gguf_weights  # noqa: E402
from engine.checkpoint.source import default_model_path, gguf_config_and_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded model's tokenizer and chat template alone (no weights): the fast tier's."""
    return gguf_config_and_tokenizer(default_model_path())[1]


@pytest.fixture(scope="session")
def smol_parts():
    """(config, tokenizer, HF-named fp32 state dict) of the embedded SmolLM2 GGUF."""
    path = default_model_path()
    config, tokenizer = gguf_config_and_tokenizer(path)
    return config, tokenizer, dict(gguf_weights(path, config))


@pytest.fixture(scope="session")
def hf_smol(smol_parts):
    """transformers' own LlamaForCausalLM with the same weights: the reference."""
    from transformers import AutoModelForCausalLM

    config, _, state = smol_parts
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def smol32():
    """SmolLM2 in fp32, dense (the GGUF's weights dequantized, as transformers reads them), with a
    modest pool, shared by the tests that do not change its config."""
    return LLM(dtype="float32", quantization="none", num_kv_blocks=1024, max_model_len=2048)


@pytest.fixture(scope="session")
def gptq_cache(tmp_path_factory):
    """A cache folder shared by the tests that run our GPTQ on SmolLM2 (~40-110 s here), by every
    xdist worker too: whichever first holds its lock (`gptq_lock`) writes the checkpoint where the
    operator's "gptq (quantize now)" looks for it, the others reuse it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's folder, above each worker's own
    path = base / "gptq-cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture
def gptq_lock(gptq_cache):
    from filelock import FileLock

    return FileLock(os.path.join(gptq_cache, ".lock"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, smol_parts):
    path = tmp_path_factory.mktemp("tokenizer")
    smol_parts[1].save_pretrained(path)
    return path


TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mistral-window", "qwen2-window", "gemma2", "gemma3")
WINDOW = 8  # the "-window" archs' sliding window: half a block, so windows start inside blocks


def tiny_config(arch: str, vocab_size: int):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=arch in ("qwen2", "qwen3", "gemma2", "gemma3"))
    if arch == "llama":
        return LlamaConfig(**common, head_dim=16,
                           rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if arch == "mistral":
        return MistralConfig(**common, head_dim=16, sliding_window=None)
    if arch == "mistral-window":
        return MistralConfig(**common, head_dim=16, sliding_window=WINDOW)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen2-window":  # layer 0 attends to all, layer 1 to its window
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if arch == "gemma2":  # layer 0 local (a window), layer 1 global; scores and logits softcapped
        return Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if arch == "gemma3":  # local and global layers with their own RoPE (10k / 1M, linear scaling x2)
        return Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1000000.0}})
    return Qwen3Config(**common, head_dim=32)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: a random-weight model of one architecture saved as a HF folder (safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = {}

    def make(arch: str, std: float = 0.2):
        """std: the 2-D weights' init; 0.2 gives peaked logits (decisive greedy tests), 0.02 (the
        transformers default) a smooth model where small weight errors stay small."""
        if (arch, std) not in made:
            torch.manual_seed(1234)
            tok = AutoTokenizer.from_pretrained(tokenizer_dir)
            model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok)), dtype=torch.float32)
            with torch.no_grad():  # larger weights than the default init: peaked, decisive logits
                for p in model.parameters():
                    if p.dim() == 2:
                        p.normal_(0, std)
                    elif arch.startswith("gemma"):  # its norms scale by 1 + w: make w matter
                        p.normal_(0, 0.3)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            tok.save_pretrained(path)
            made[arch, std] = (str(path), model.eval())
        return made[arch, std]

    return make


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, tokenizer_dir):
    """A random-weight Llama with room for a few turns of the ~300-token system prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config("llama", len(tok))
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-chat")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---- test tiers (pytest.ini's markers; `make test-fast` runs `-m "not e2e"`) -----------------------
MODEL_FIXTURES = {"smol_parts", "hf_smol", "smol32", "tiny_model", "tiny_chat_model"}


def pytest_collection_modifyitems(config, items):
    """A test that takes a model fixture is e2e, whatever its module says. Modules holding a slow or
    browser test run first (in their own order): `make test` spreads whole modules over three
    workers (pytest-xdist, --dist loadfile), and the longest started first end together."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
    heavy = {item.module for item in items if item.get_closest_marker("slow") or item.get_closest_marker("browser")}
    items.sort(key=lambda item: item.module not in heavy)


@pytest.fixture(autouse=True)
def _fast_tier_loads_no_model(request, monkeypatch):
    """A test not marked e2e that loads a model fails here, so the fast tier stays fast and its
    markers stay true."""
    if request.node.get_closest_marker("e2e") is None:
        import engine.llm_engine

        def refuse(*args, **kwargs):
            raise AssertionError("this test loads a model: mark it e2e (pytest.mark.e2e)")
        monkeypatch.setattr(engine.llm_engine, "load", refuse)
