"""Model architectures by the `architectures` name in a transformers config."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def model_class(hf_config):
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and hf_config.model_type in MODEL_TYPES:
        names = [MODEL_TYPES[hf_config.model_type]]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported architecture {names or hf_config.model_type}; "
                     f"supported: {', '.join(ARCHITECTURES)}")
