"""Model architectures: the contract a model class meets and the registry (registry.py); each
model module registers its classes when imported here."""
from __future__ import annotations

from engine.models import gemma, llama  # noqa: F401  (register the Gemma and Llama families)
from engine.models.registry import ARCHITECTURES, MODEL_TYPES, CausalLM, model_class, register_model

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "CausalLM", "model_class", "register_model"]
