"""Stream a checkpoint's tensors into our model, once: dense tensors into their (possibly fused)
parameters, 4-bit tensors kept as Packed4 for the int4 kernel (or dequantized when the kernel
cannot take them). One name mapping, the model's `packed_modules_mapping`, serves every format:
GGUF tensors are renamed to transformers names first."""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from torch import nn

from engine.checkpoint.gguf import gguf_weights
from engine.checkpoint.quantized import Packed4, Packed8, QuantSpec, detect, to_int4
from engine.checkpoint.source import ModelSource
from engine.linear import default_weight_loader
from engine.models import model_class

Weights = Iterator[tuple[str, "torch.Tensor | Packed4"]]


def quant_spec(src: ModelSource, hf_config) -> QuantSpec | None:
    """The 4-bit format of a folder checkpoint, None for full precision (GGUF: see gguf.py)."""
    return detect(src.path, hf_config) if src.kind == "folder" else None


def iter_weights(src: ModelSource, hf_config, keep_packed: bool = False) -> Weights:
    """(transformers name, tensor) for every weight; with `keep_packed`, 4-bit layers as Packed4."""
    if src.kind == "gguf":
        yield from gguf_weights(src.path, hf_config, keep_packed)
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(src.path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {src.path} has no .safetensors files")
    spec = quant_spec(src, hf_config)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a 4-bit layer's parts may span files
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                prefix, _, part = name.rpartition(".")
                if spec is not None and part in spec.parts:
                    pending.setdefault(prefix, {})[part] = f.get_tensor(name)
                else:
                    yield name, f.get_tensor(name)
    for prefix, parts in pending.items():
        packed = to_int4(spec, parts)
        yield f"{prefix}.weight", packed if keep_packed else packed.dequantize()


def load_weights(model: nn.Module, weights: Weights) -> dict[str, list[Packed4]]:
    """Place every tensor; returns the packed shards per Linear (shards in fused order). A fused
    Linear with only some shards packed gets them dequantized into its dense weight instead."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    mapping = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    packed: dict[str, list[Packed4 | None]] = {}
    for name, value in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and model.lm_head.tied):
            continue
        target, shard_id = _target(name, mapping)
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in the model")
        loaded.add(target)
        if isinstance(value, (Packed4, Packed8)):
            module = modules[target.rsplit(".", 1)[0]]
            shards = packed.setdefault(target.rsplit(".", 1)[0], [None] * max(1, len(module.shard_offsets)))
            shards[list(module.shard_offsets).index(shard_id) if shard_id is not None else 0] = value
            continue
        _place(params[target], value, shard_id)
    for module_name, shards in list(packed.items()):
        if any(s is None for s in shards):
            place_dequantized(modules[module_name], shards)
            del packed[module_name]
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    return packed


def place_dequantized(module: nn.Module, shards: list) -> None:
    """A Linear's packed shards (None: placed already) dequantized into its dense weight."""
    for shard_id, shard in zip(module.shard_offsets or [None], shards):
        if shard is not None:
            _place(module.weight, shard.dequantize(), shard_id)


def _target(name: str, mapping: dict) -> tuple[str, str | int | None]:
    for ckpt_key, (fused, shard_id) in mapping.items():
        if f".{ckpt_key}." in name:
            return name.replace(f".{ckpt_key}.", f".{fused}."), shard_id
    return name, None


def _place(param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        default_weight_loader(param, tensor.to(param.dtype))
    else:
        loader(param, tensor.to(param.dtype), shard_id)


def build_model(src: ModelSource, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int,
                keep_packed: bool) -> tuple[nn.Module, dict[str, list[Packed4]]]:
    """Our model with its weights, and the 4-bit shards kept packed (empty unless `keep_packed`)."""
    cls = model_class(hf_config)
    with torch.device(device):
        model = cls(hf_config, max_positions).to(dtype)
    packed = load_weights(model, iter_weights(src, hf_config, keep_packed))
    model.eval()
    return model, packed
