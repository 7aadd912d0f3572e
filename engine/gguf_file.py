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


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def gguf_int4_blocks(path: str, hf_config) -> dict[str, list]:
    """Q4_0 / Q4_1 tensors as the int4 kernel's (q [N, K], scales [G, N], zeros [G, N]), read from
    the raw blocks (no float round trip), keyed by our fused Linear names; None for other types."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    out: dict[str, list] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or not name.endswith("proj.weight"):
            continue
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused, index = _FUSED.get(leaf, (leaf, 0))
        parts = out.setdefault(f"{parent}.{fused}", [None] * (3 if fused == "qkv_proj" else 2 if fused == "gate_up_proj" else 1))
        parts[index] = _int4_from_blocks(t, name, arch, hf_config)
    return out


def _int4_from_blocks(t, name: str, arch: str, hf_config):
    import gguf

    kind = t.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return None
    rows = t.data.shape[0]
    block = 18 if kind == gguf.GGMLQuantizationType.Q4_0 else 20
    raw = np.ascontiguousarray(t.data).reshape(rows, -1, block)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    if kind == gguf.GGMLQuantizationType.Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d  # x = d*q + m  ==  (q - 8)*d + (m + 8d)
    else:
        zeros = np.zeros_like(d)  # x = d*(q - 8)
    nibbles = raw[..., block - 16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1).astype(np.int32)
    q, d, zeros = torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
        q, d, zeros = (unpermute_rows(x, heads) for x in (q, d, zeros))
    return q, d.T.contiguous(), zeros.T.contiguous()
