"""The KV block pool: every block of the preallocated cache, its reference count, and the
prefix cache (chained block hash -> block).

A block is in exactly one state:
  free        ref_cnt == 0, no hash, in the free queue
  cached-free ref_cnt == 0, hash kept, in the free queue (evictable, reusable on a hit)
  in use      ref_cnt >= 1, not in the free queue (hash kept if it is full and registered)
The free queue is in eviction order: the front is evicted first. Freed blocks go to the back,
so the least recently used cached block is the first one reused for new data.
Not thread-safe: only the engine thread touches it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # confirms a hash hit token for token

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """Chained hash: a block's identity covers every token before it (and the tenant salt). A 128-bit
    BLAKE2b, the same in every process, so the disk tier can name files by it across restarts."""
    h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(16, "little"))
    if extra_key is not None:
        h.update(b"salt:" + str(extra_key).encode())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        self._cached_free = 0  # free blocks that still hold a hash, kept as blocks change state

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that a new allocation may take (clean and cached-free)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        return self._cached_free

    # ---- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
                self._cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue in the
        given order (callers pass a request's blocks tail first, so its tail is evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                self._cached_free += block.block_hash is not None

    # ---- prefix cache -------------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full block. If another block already holds this content, keep the first."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's hash (its content is not what the hash says)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            self._cached_free -= 1
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use keep their data; they simply stop being shared."""
        for block in list(self.cached.values()):
            self._evict(block)
        self.num_evictions = 0

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block in exactly one state; the cache map and the blocks agree."""
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            if block.ref_cnt < 0 or (block.ref_cnt == 0) != in_queue:
                raise AssertionError(f"{block} inconsistent with free queue (in_queue={in_queue})")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise AssertionError(f"{block} has a hash that the cache map does not point to")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache map entry {block_hash} points at {block}")
        counted = sum(1 for i in self.free_queue if self.blocks[i].block_hash is not None)
        if counted != self._cached_free:
            raise AssertionError(f"{counted} cached free blocks, counter says {self._cached_free}")
