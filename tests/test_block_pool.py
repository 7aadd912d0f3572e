"""Block pool and per-request block tables: states, reference counts, LRU eviction order."""
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def test_free_queue_evicts_least_recently_freed_first():
    pool = BlockPool(6)
    a, b, c = (pool.get_new_blocks(1)[0] for _ in range(3))
    for i, block in enumerate((a, b, c)):
        pool.cache_block(block, 100 + i, [i])
    pool.free([b])
    pool.free([c])
    pool.free([a])
    # Never-used blocks 3, 4, 5 come first, then the cached ones in the order they were freed.
    assert [blk.block_id for blk in pool.get_new_blocks(6)] == [3, 4, 5, b.block_id, c.block_id, a.block_id]
    assert pool.num_evictions == 3 and not pool.cached


def test_request_tail_blocks_are_evicted_before_its_head():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    req = make_request("r", list(range(13)))  # 3 full blocks + 1 token
    assert kv.allocate_slots(req, 13)
    head, mid, tail, partial = kv.req_blocks["r"]
    kv.free(req)
    order = [b.block_id for b in kv.pool.get_new_blocks(8)]
    # untouched blocks first, then the request's blocks tail first (the head is the most shareable)
    assert order[-4:] == [partial.block_id, tail.block_id, mid.block_id, head.block_id]


def test_cache_hit_touches_blocks_and_confirms_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    first = make_request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    kv.free(first)
    assert kv.pool.num_cached_free == 2
    same = make_request("b", list(range(10)))
    hits = kv.get_computed_blocks(same)
    assert [b.block_hash for b in hits] == same.block_hashes[:2]
    assert kv.allocate_slots(same, 2, hits)
    assert all(b.ref_cnt == 1 for b in hits) and kv.pool.num_cached_free == 0
    other = make_request("c", [0, 1, 2, 99] + list(range(4, 10)))
    assert kv.get_computed_blocks(other) == []  # chained: block 2 differs because block 1 does
    salted = make_request("d", list(range(10)))
    salted.cache_salt = "tenant-2"
    assert kv.get_computed_blocks(salted) == []
    kv.free(same)
    kv.pool.check_integrity()


def test_last_prompt_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    req = make_request("a", list(range(8)))
    assert kv.allocate_slots(req, 8)
    kv.free(req)
    again = make_request("b", list(range(8)))
    assert len(kv.get_computed_blocks(again)) == 1  # 8 tokens = 2 full blocks, only 1 reusable


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    req = make_request("a", list(range(20)))
    assert not kv.allocate_slots(req, 20)
    assert kv.pool.num_free == 3 and "a" not in kv.req_blocks


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "abort", "reset"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([4, 16]), st.booleans())
def test_random_sequences_keep_every_block_in_exactly_one_state(operations, block_size, caching):
    kv = KVCacheManager(num_blocks=24, block_size=block_size, enable_caching=caching)
    live: dict[str, Request] = {}
    for op, key, n in operations:
        rid = f"r{key}"
        if op == "add" and rid not in live:
            # a few shared prefixes so the cache is exercised
            req = make_request(rid, [key % 3] * 8 + list(range(n)))
            hits = kv.get_computed_blocks(req)
            todo = req.num_tokens - len(hits) * block_size
            if kv.allocate_slots(req, todo, hits):
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
        elif op == "grow" and rid in live:
            req = live[rid]
            for t in range(n % 9):
                req.append_output_token(1000 + t)
                if not kv.allocate_slots(req, 1):
                    req.all_token_ids.pop()
                    req.output_token_ids.pop()
                    break
                req.num_computed_tokens += 1
        elif op in ("free", "abort") and rid in live:
            kv.free(live.pop(rid))
        elif op == "reset":
            kv.reset_prefix_cache()
        kv.pool.check_integrity()
        used = sum(len(kv.req_blocks[r]) for r in live)
        assert kv.pool.num_used <= used  # shared blocks count once
    for req in live.values():
        kv.free(req)
    kv.pool.check_integrity()
    assert kv.pool.num_used == 0 and kv.pool.num_free == 24
