"""The model contract and the registry of architectures (by the `architectures` name of a
transformers config, or its model_type when that list is missing)."""
from __future__ import annotations

from typing import Protocol

import torch


class CausalLM(Protocol):
    """What a model class offers the rest of the engine.
    The loader: `__init__(hf_config, max_positions)`; parameters that load through their
        `weight_loader` where they are fused, and `packed_modules_mapping` (checkpoint name ->
        (fused parameter, shard id)).
    The quantizer: every matmul an engine.linear.Linear, the LM head included (`lm_head`, tied to
        the embedding or its own weight).
    The runner: `forward(input_ids [T], positions [T]) -> hidden [T, H]` over a flat batch through
        the paged KV cache, `compute_logits(hidden) -> fp32 logits`, `attention_layers()` (the
        PagedAttention modules the runner binds the KV cache to); where a class has it, `fuse_layers()`,
        which the runner calls once the KV pools are bound (Llama's: engine/fused_layers.py)."""
    packed_modules_mapping: dict[str, tuple[str, str | int]]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list: ...


CONTRACT = ("packed_modules_mapping", "forward", "compute_logits", "attention_layers")
ARCHITECTURES: dict[str, type] = {}
MODEL_TYPES: dict[str, str] = {}  # model_type -> architecture, for configs without `architectures`


def register_model(*architectures: str, model_types: dict[str, str] | None = None):
    """Class decorator: serve `architectures` with this class (refused if it lacks the contract)."""
    def register(cls: type) -> type:
        missing = [name for name in CONTRACT if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"{cls.__name__} lacks {missing} of the model contract (engine/models/registry.py)")
        for name in architectures:
            ARCHITECTURES[name] = cls
        MODEL_TYPES.update(model_types or {})
        return cls
    return register


def model_class(hf_config) -> type:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and hf_config.model_type in MODEL_TYPES:
        names = [MODEL_TYPES[hf_config.model_type]]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported architecture {names or hf_config.model_type}; "
                     f"supported: {', '.join(ARCHITECTURES)}")
