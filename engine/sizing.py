"""How big things are at load: the context length, the KV pool, which tokens end a sequence."""
from __future__ import annotations

import psutil
import torch

from engine.config import EngineConfig

MAX_DEFAULT_MODEL_LEN = 8192
CPU_KV_CAP_BYTES = 2 << 30


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
    if requested is None:
        return min(model_max, MAX_DEFAULT_MODEL_LEN)
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {model_max}")
    return requested


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """As configured, else a memory budget: half the free GPU memory, or a quarter of available RAM
    capped at 2 GiB on the CPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(device)[0] * 0.5)
        else:
            budget = min(int(psutil.virtual_memory().available * 0.25), CPU_KV_CAP_BYTES)
    blocks = budget // bytes_per_block
    if blocks < 2:
        raise ValueError(f"kv_cache_memory_bytes {budget} holds fewer than 2 blocks of {bytes_per_block} bytes")
    return blocks


def eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def fit_to_pool(max_model_len: int, asked: int | None, num_blocks: int, block_size: int) -> int:
    """A sequence must fit the pool: an asked-for max_model_len that does not is an error, the
    model's own limit is capped."""
    capacity = num_blocks * block_size
    if capacity >= max_model_len:
        return max_model_len
    if asked is not None:
        raise ValueError(f"max_model_len {asked} does not fit the KV cache "
                         f"({num_blocks} blocks x {block_size} = {capacity} tokens)")
    return capacity
