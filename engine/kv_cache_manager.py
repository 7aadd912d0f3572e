"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing."""
from __future__ import annotations

from engine.block_pool import BlockPool, KVBlock, hash_block
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _update_hashes(self, req: Request, num_full_blocks: int) -> None:
        bs, hashes, tokens = self.block_size, req.block_hashes, req.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], req.cache_salt if i == 0 else None))

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest run of this request's full blocks already in the cache. At least one
        token is always left to compute, so the last prompt token is never a hit. A request that
        wants prompt logprobs computes its whole prompt (a hit has no logits to score)."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks)
        bs, hits = self.block_size, []
        for i in range(max_blocks):
            block = self.pool.lookup(req.block_hashes[i], req.all_token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | tuple = ()) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens (plus any newly hit
        blocks). False, with nothing changed, when the pool cannot hold them."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed + revived > self.pool.num_free:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if needed > 0:
            blocks.extend(self.pool.get_new_blocks(needed))
        if self.enable_caching:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens) // self.block_size)
        return True

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_full: int) -> None:
        """Register blocks that are full once this step's tokens are written. Their K/V is
        written before any attention reads it in the same forward, so sharing is safe."""
        self._update_hashes(req, num_full)
        bs, tokens = self.block_size, req.all_token_ids
        for i in range(num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], req.block_hashes[i], tokens[i * bs:(i + 1) * bs])

    def fork(self, parent: Request, child: Request, num_tokens: int) -> tuple[int, int] | None:
        """Give `child` the parent's first `num_tokens` tokens: the blocks before the one holding the
        last token shared (a reference each), that one copied into a new block. Returns (source,
        copy) for the runner to copy, or None when no block is free."""
        if self.pool.num_free < 1:
            return None
        last = (num_tokens - 1) // self.block_size
        parent_blocks = self.req_blocks[parent.request_id]
        shared = parent_blocks[:last]
        self.pool.touch(shared)
        copy = self.pool.get_new_blocks(1)[0]
        self.req_blocks[child.request_id] = [*shared, copy]
        return parent_blocks[last].block_id, copy.block_id

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
