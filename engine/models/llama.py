"""The Llama family in one implementation: Llama, Mistral (sliding window), SmolLM, Qwen2 (qkv
bias; sliding window on its upper layers with use_sliding_window), Qwen3 (q/k RMSNorm). Input is a
flat batch of tokens; attention goes through the paged KV cache."""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import PagedAttention, layer_window, step_metadata
from engine.fused_layers import FusedLayers
from engine.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from engine.linear import Linear
from engine.models.registry import register_model


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, window: int | None = None, *, scale: float | None = None,
                 softcap: float | None = None, norm: type[RMSNorm] = RMSNorm) -> None:
        """window: layer_window's; scale: the scores' (head_dim ** -0.5 unless given: Gemma's
        query_pre_attn_scalar); softcap: Gemma 2's; norm: the q/k norms' kind (Qwen3 and Gemma 3 have them)."""
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        is_qwen2 = cfg.model_type == "qwen2"
        qkv_bias = is_qwen2 or getattr(cfg, "attention_bias", False)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=qkv_bias,
                               shard_sizes={"q": q_size, "k": kv_size, "v": kv_size})
        o_bias = getattr(cfg, "attention_bias", False) and not is_qwen2
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.model_type in ("qwen3", "gemma3_text")
        if self.qk_norm:
            self.q_norm = norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5 if scale is None else scale, window, softcap)
        self.split = [q_size, kv_size, kv_size]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, act: nn.Module | None = None) -> None:
        """act: the gated activation over [gate, up] (SiLU; Gemma passes GeGLU)."""
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=getattr(cfg, "mlp_bias", False),
                                   shard_sizes={0: inter, 1: inter})
        self.down_proj = Linear(inter, cfg.hidden_size, bias=getattr(cfg, "mlp_bias", False))
        self.act = act or SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer_window(cfg, index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None):
        """The residual stream travels beside the hidden state, so each add fuses into the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused: FusedLayers | None = None  # fuse_layers'

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        meta = step_metadata()
        if self.fused is not None and self.fused.serves(h, meta):
            h, residual = self.fused(h, positions, meta)
        else:
            for layer in self.layers:
                h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"})
class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        tied = self.model.embed_tokens.weight if getattr(cfg, "tie_word_embeddings", False) else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def fuse_layers(self) -> None:
        """Run the decoder stack as one C call where it can (engine/fused_layers.py): once the weights
        and KV pools are final."""
        self.model.fused = FusedLayers.build(self.model.layers)
