"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing, and
the one door to the disk tier (engine/kv_disk.py) when one is attached (vLLM's KV connector split):
the scheduler and LLMEngine call only this class; the block copies live with the model runner, so
this side holds no tensors and imports no torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from engine.block_pool import BlockPool, KVBlock, hash_block
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_disk import DiskStats, DiskStore


class BlockCopier(Protocol):
    """What the disk tier needs of the model runner: one block's K and V out, and back in."""

    def read_block(self, block_id: int) -> Any: ...

    def write_block(self, block_id: int, kv: Any) -> None: ...


# Holds the place of a block every layer's window has passed (_free_out_of_window): block 0's id in
# the table, never read (the kernels start at each row's window; the torch paths mask it out).
OUT_OF_WINDOW = KVBlock(0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, window: int | None = None) -> None:
        """`window`: the sliding window when every attention layer has one (Mistral): blocks that
        fell out of it go back to the pool while their request runs."""
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_window_start: dict[str, int] = {}  # blocks before it are OUT_OF_WINDOW
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.disk: DiskStore | None = None
        self.disk_queries = 0  # tokens looked up on disk (past the pool's hit)
        self.disk_hits = 0  # tokens loaded back from disk

    def attach_disk(self, store: DiskStore, copier: BlockCopier) -> None:
        """Full blocks are copied to `store` as they are computed; prefix lookups continue there."""
        self.disk, self._copier = store, copier

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
        if self.window is not None:
            self._free_out_of_window(req.request_id, blocks, num_computed)
        return True

    def _free_out_of_window(self, request_id: str, blocks: list[KVBlock], num_computed: int) -> None:
        """The first token this step computes attends back to num_computed - window + 1, later ones
        further on: blocks wholly before it are read by no layer again. They go back to the pool (a
        full one stays in the prefix cache, evictable) and OUT_OF_WINDOW keeps their place."""
        start = self.req_window_start.get(request_id, 0)
        end = max(0, num_computed - self.window + 1) // self.block_size
        for i in range(start, end):
            if blocks[i] is not OUT_OF_WINDOW:
                self.pool.free([blocks[i]])
                blocks[i] = OUT_OF_WINDOW
        self.req_window_start[request_id] = max(start, end)

    def _cache_full_blocks(self, req: Request, blocks: list[KVBlock], num_full: int) -> None:
        """Register blocks that are full once this step's tokens are written. Their K/V is
        written before any attention reads it in the same forward, so sharing is safe."""
        self._update_hashes(req, num_full)
        bs, tokens = self.block_size, req.all_token_ids
        for i in range(num_full):
            if blocks[i].block_hash is None and blocks[i] is not OUT_OF_WINDOW:
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
        self.pool.touch(b for b in shared if b is not OUT_OF_WINDOW)
        copy = self.pool.get_new_blocks(1)[0]
        self.req_blocks[child.request_id] = [*shared, copy]
        if request_start := self.req_window_start.get(parent.request_id):
            self.req_window_start[child.request_id] = min(request_start, last)
        return parent_blocks[last].block_id, copy.block_id

    def free(self, req: Request, written_tokens: int | None = None) -> None:
        """Release a request's blocks. With `written_tokens` (a request preempted in the step that
        scheduled it), blocks registered past them lose their hash: their K/V was never written."""
        blocks = self.req_blocks.pop(req.request_id, None)
        self.req_window_start.pop(req.request_id, None)
        if not blocks:
            return
        for block in blocks[written_tokens // self.block_size:] if written_tokens is not None else ():
            if block.block_hash is not None and block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free(b for b in reversed(blocks) if b is not OUT_OF_WINDOW)

    def free_past(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks after the first `num_tokens` tokens (slots of rejected drafts: they
        were never registered, since drafts are not the request's tokens)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(extra))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: the pool's and the disk tier's."""
        self.pool.reset_prefix_cache()
        if self.disk is not None:
            self.disk.clear()

    # ---- the disk tier --------------------------------------------------------------------
    def save_computed(self, scheduled: list) -> None:
        """Write-through, after the forward: each full block is copied out once, in the step that
        filled it, and written by the disk tier's thread. So eviction costs nothing, and a killed
        process loses only the writes still queued. Without a disk tier: nothing."""
        if self.disk is None:
            return
        bs = self.block_size
        for s in scheduled:
            req = s.request
            blocks = self.req_blocks.get(req.request_id, ())
            written = req.num_computed_tokens + s.num_tokens - len(s.draft_token_ids)  # drafts: not yet its tokens
            full = min(written // bs, len(blocks))
            for block in blocks[req.num_saved_blocks:full]:
                if block.block_hash is not None and not self.disk.contains(block.block_hash):
                    self.disk.save(block.block_hash, block.token_ids, self._copier.read_block(block.block_id))
            req.num_saved_blocks = max(req.num_saved_blocks, full)

    def start_disk_load(self, req: Request) -> bool:
        """Once per queueing: if the prefix continues on disk past the pool's hit, ask the reader
        thread for those blocks and return True (the request waits aside until they are read)."""
        if self.disk is None or req.disk_checked or not self.enable_caching or req.params.prompt_logprobs is not None:
            return False
        req.disk_checked = True
        start = len(self.get_computed_blocks(req))
        bs, end, limit = self.block_size, start, (req.num_tokens - 1) // self.block_size
        while end < limit and self.disk.contains(req.block_hashes[end]):
            end += 1
        self.disk_queries += (limit - start) * bs
        if end == start:
            return False
        tokens = req.all_token_ids
        self.disk.load(req.request_id, [(req.block_hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
                                        for i in range(start, end)])
        return True

    def adopt_loaded(self, req: Request) -> None:
        """Put the blocks read for `req` into the pool as cached-free blocks (most recently used), so the
        ordinary prefix lookup finds them. The pool's own hits are held meanwhile so none is evicted."""
        loaded = self.disk.take_loaded(req.request_id) if self.disk is not None else None
        if not loaded:
            return
        held = self.get_computed_blocks(req)
        self.pool.touch(held)
        try:
            for item in loaded:
                if self.pool.lookup(item.block_hash, item.token_ids) is not None:
                    continue
                if self.pool.num_free == 0:
                    break
                block = self.pool.get_new_blocks(1)[0]
                self._copier.write_block(block.block_id, item.kv)
                self.pool.cache_block(block, item.block_hash, item.token_ids)
                self.pool.free([block])
                self.disk_hits += self.block_size
        finally:
            self.pool.free(reversed(held))

    def loaded_requests(self) -> list[str]:
        """Requests whose disk blocks the reader has in memory now (start_disk_load's)."""
        return self.disk.finished() if self.disk is not None else []

    def cancel_disk_load(self, request_id: str) -> None:
        if self.disk is not None:
            self.disk.cancel(request_id)

    def wait_for_disk(self, timeout: float) -> None:
        """Block until the reader finishes a load or `timeout` passes (nothing else to run meanwhile)."""
        if self.disk is not None:
            self.disk.wait_for_load(timeout)

    def disk_stats(self) -> DiskStats | None:
        return self.disk.stats if self.disk is not None else None

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop its threads."""
        if self.disk is not None:
            self.disk.close()
