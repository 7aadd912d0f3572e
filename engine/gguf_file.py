"""GGUF checkpoints read with the `gguf` package: llama.cpp tensor names mapped to transformers
names, llama.cpp's q/k row permutation undone, and the config and tokenizer converted once by
transformers and cached on disk (converting the tokenizer alone takes seconds every start)."""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    m = _LAYER_RE.match(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return part and f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    top = _TOP_NAMES.get(base)
    return top and f"{top}.{kind}"


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores llama q/k rows interleaved per head; put them back in HF order."""
    n = w.shape[0]
    return w.reshape(num_heads, n // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {arch} model")
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
            w = unpermute_rows(w, heads)
        yield name, w


def gguf_config_and_tokenizer(path: str):
    from transformers import AutoConfig, AutoTokenizer

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("PAGEDCHAT_CACHE", os.path.expanduser("~/.cache/pagedchat")), "gguf", key)
    if os.path.isfile(os.path.join(cache, "config.json")):
        try:
            return AutoConfig.from_pretrained(cache), AutoTokenizer.from_pretrained(cache)
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt below
            pass
    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        tmp = f"{cache}.tmp{os.getpid()}"
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs the conversion at the next start
    return config, tokenizer
