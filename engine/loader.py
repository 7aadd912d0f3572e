"""Loading a model, in one order: source -> config and tokenizer -> weights into our model ->
quantized kernels -> their tiles, by measurement -> identity -> dense packing -> size. LLMEngine takes
the result as it is."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.checkpoint.load import build_model, quant_spec
from engine.checkpoint.source import ModelSource, load_config_and_tokenizer, resolve_model, sampling_defaults
from engine.config import EngineConfig
from engine.kv_disk_format import model_identity
from engine.linear import weight_bytes
from engine.quant.choices import choose_mode
from engine.quant.choose import choose_tiles
from engine.quant.kernels import int8_rows_in_use
from engine.quant.methods import pack_dense_linears, quantize_linears, share_tied_embedding
from engine.sizing import resolve_max_model_len

log = logging.getLogger("pagedchat.loader")


@dataclass
class LoadedModel:
    source: ModelSource
    hf_config: object
    tokenizer: object
    model: nn.Module
    max_model_len: int  # before the KV pool is sized (sizing.fit_to_pool may lower it)
    quantization: str  # the mode chosen (choices.choose_mode)
    quantization_shown: str  # what the panel and the log show: "gguf, int8 rows" where rows meet 4-bit as int8
    identity: bytes  # what a block's K/V depends on (names the disk tier's folder)
    weight_bytes: int
    sampling_defaults: dict
    sampling_source: str


def load(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """The model `config` names (see checkpoint.source.resolve_model) with every Linear on its final
    kernel, in `dtype` on `device`. Raises ValueError for a model or quantization that cannot be loaded."""
    quantization, max_model_len, block_size = config.quantization, config.max_model_len, config.block_size
    source = resolve_model(config.model)
    hf_config, tokenizer = load_config_and_tokenizer(source)
    max_len = resolve_max_model_len(hf_config, max_model_len)
    spec = quant_spec(source, hf_config)
    mode = choose_mode(quantization, spec, source.kind, dtype)
    keep_packed = mode in ("gguf", getattr(spec, "method", None))  # 4-bit layers stay 4-bit
    net, packed = build_model(source, hf_config, dtype, device, max_len, keep_packed=keep_packed)
    if "dequantized" in mode:
        log.info("%s checkpoint dequantized to %s at load (no packed kernel takes that dtype here)", spec.method, dtype)
    quantize_linears(net, mode, dtype, packed, config.int8_activations, config.dense_prompt_weights)
    choose_tiles(net, bf16_tiles=not config.batch_invariant)
    kv = config.kv_cache_dtype
    kv_mode = mode if kv == "auto" else f"{mode}|kv {kv}"  # int8 blocks: other bytes
    identity = model_identity(net, dtype, kv_mode, block_size)  # before packing: the weights as loaded
    pack_dense_linears(net)
    if share_tied_embedding(net):  # the lookup reads the LM head's int8 rows: another model for the disk tier
        identity = model_identity(net, dtype, f"{kv_mode}|embedding {identity.hex()}", block_size)
    shown = mode + (", int8 rows" if int8_rows_in_use(net) else "")
    defaults, defaults_source = sampling_defaults(source)
    return LoadedModel(source, hf_config, tokenizer, net, max_len, mode, shown, identity, weight_bytes(net),
                       defaults, defaults_source)
