"""Gemma 2 and Gemma 3 (text), in one implementation: GeGLU, (1 + w) RMSNorm around both the
attention and the MLP, embeddings scaled by sqrt(hidden), local (sliding-window) and global layers
(Gemma 3: each with its own RoPE), q/k RMSNorm (Gemma 3), logit softcapping where the config asks
(Gemma 2: the attention scores' and the final logits'). Safetensors checkpoints (llama.cpp's GGUF
names for Gemma are not mapped)."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import layer_window
from engine.layers import GeluAndMul, OffsetRMSNorm, RotaryEmbedding
from engine.linear import Linear
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.models.registry import register_model


def gemma_attention(cfg, rotary: RotaryEmbedding, index: int) -> LlamaAttention:
    """Llama's attention with Gemma's score scale, (1 + w) q/k norms (Gemma 3) and score softcap
    (Gemma 2; Gemma 3's forward never applies one, whatever its config says)."""
    softcap = None if cfg.model_type == "gemma3_text" else getattr(cfg, "attn_logit_softcapping", None)
    return LlamaAttention(cfg, rotary, layer_window(cfg, index), scale=cfg.query_pre_attn_scalar ** -0.5,
                          softcap=softcap, norm=OffsetRMSNorm)


def gemma_mlp(cfg) -> LlamaMLP:
    """Llama's gated MLP with GeGLU (`gelu_pytorch_tanh`, the only activation Gemma configs name)."""
    if getattr(cfg, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported Gemma activation {cfg.hidden_activation!r}")
    return LlamaMLP(cfg, GeluAndMul())


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.self_attn = gemma_attention(cfg, rotary, index)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.mlp = gemma_mlp(cfg)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None):
        """As LlamaDecoderLayer: the residual travels beside, each add fused into the next norm; the
        attention's and the MLP's outputs are normalised before they join it."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_scale = cfg.hidden_size ** 0.5
        per_type = cfg.model_type.startswith("gemma3")  # Gemma 3: RoPE per layer type (local / global)
        types = sorted(set(cfg.layer_types)) if per_type else [None]
        rotaries = {t: RotaryEmbedding(cfg, cfg.head_dim, max_positions, t) for t in types}
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, rotaries[cfg.layer_types[i] if per_type else None], i)
            for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h, residual = h * torch.tensor(self.embed_scale, dtype=h.dtype), None  # the scale rounded as transformers does
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


@register_model("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                model_types={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"})
class GemmaForCausalLM(LlamaForCausalLM):
    """The Llama class's head, weight names and contract over Gemma's decoder."""

    def __init__(self, cfg, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg, max_positions)
        tied = self.model.embed_tokens.weight if getattr(cfg, "tie_word_embeddings", True) else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tied_to=tied)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
