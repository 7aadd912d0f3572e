"""What the live panel shows, taken on the engine thread: stats, every KV block's state and owner,
memory. Read-only over the engine."""
from __future__ import annotations

import dataclasses
import time

import psutil
import torch

from engine.client import BlockState
from engine.kv_cache_manager import OUT_OF_WINDOW
from engine.quant.choose import amx_in_use
from engine.llm_engine import LLMEngine


def take_snapshot(engine: LLMEngine) -> dict:
    """A block's owner is its first request's session, else that request's id."""
    pool = engine.kv.pool
    states = bytearray(pool.num_blocks)
    for block in pool.blocks:
        if block.ref_cnt > 1:
            states[block.block_id] = BlockState.SHARED
        elif block.ref_cnt == 1:
            states[block.block_id] = BlockState.USED
        elif block.block_hash is not None:
            states[block.block_id] = BlockState.CACHED
    owners, positions = {}, {}
    for request_id, blocks in engine.kv.req_blocks.items():
        owner = engine.session_of(request_id) or request_id
        for i, block in enumerate(blocks):
            if block is OUT_OF_WINDOW:  # its place only: block 0 is not this request's
                continue
            owners.setdefault(block.block_id, owner)
            positions.setdefault(block.block_id, i)  # its place in that request's block table
    memory = {"rss": psutil.Process().memory_info().rss, "weights": engine.weight_bytes,
              "kv_cache": engine.runner.kv_cache_bytes, "kv_cache_dtype": engine.runner.kv_cache_dtype,
              "amx_tiles": amx_in_use(engine.model)}
    if engine.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(engine.device)
        memory.update(cuda_allocated=torch.cuda.memory_allocated(engine.device),
                      cuda_reserved=torch.cuda.memory_reserved(engine.device), cuda_free=free, cuda_total=total)
    drafting = {engine.session_of(r.request_id) or r.request_id: [r.num_draft_tokens, r.num_accepted_tokens]
                for r in engine.scheduler.running if r.num_draft_tokens}
    speculation = {"on": engine.scheduler.proposer is not None, "requests": drafting}
    return {"time": time.time(), "stats": dataclasses.asdict(engine.get_stats()), "block_states": bytes(states),
            "speculation": speculation,
            "block_owners": owners, "block_positions": positions, "memory": memory, "model": engine.source.name, "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."), "quantization": engine.quantization_shown}
