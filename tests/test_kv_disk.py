"""The KV tier on disk: files that survive a restart, checks that turn corruption into a miss, a size
bound, loads that never hold up other requests, and greedy output that does not depend on it."""
import os
import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, parse_bytes
from engine.kv_cache_manager import KVCacheManager
from engine.kv_disk import DiskStore
from engine.kv_disk_format import model_identity
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats
from engine.request import Request
from ui.panel import disk_line

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHAPE = (2, 16, 2, 8)  # layers, block size, kv heads, head dim


def make_store(folder, capacity=2**30, identity=b"m" * 16) -> DiskStore:
    return DiskStore(str(folder), identity, capacity, SHAPE, torch.bfloat16)


def random_block(seed: int) -> torch.Tensor:
    return torch.randn((2, *SHAPE), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def read_back(store: DiskStore, wanted) -> list:
    store.load("r", wanted)
    while "r" not in store.finished():
        store.wait_for_load(timeout=5)
    return store.take_loaded("r")


def test_blocks_round_trip_and_survive_a_new_store(tmp_path):
    store = make_store(tmp_path)
    blocks = {h: random_block(h) for h in (11, 12, 13)}
    for h, kv in blocks.items():
        store.save(h, tuple(range(h, h + 16)), kv)
    store.close()
    again = make_store(tmp_path)  # a restart: the index is rebuilt from the folder
    assert again.stats.blocks == 3 and again.contains(12)
    loaded = read_back(again, [(h, tuple(range(h, h + 16))) for h in blocks])
    assert [b.block_hash for b in loaded] == [11, 12, 13]
    for b in loaded:
        assert torch.equal(b.kv, blocks[b.block_hash])
    assert again.stats.hit_blocks == 3 and again.stats.read_bytes > 0
    again.close()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "wrong tokens", "older format"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    store = make_store(tmp_path)
    for h in (1, 2, 3):
        store.save(h, tuple(range(16)), random_block(h))
    store.flush()
    path = store._path(2)
    data = bytearray(open(path, "rb").read())
    wanted = [(h, tuple(range(16))) for h in (1, 2, 3)]
    if damage == "flip a payload byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "older format":  # format 1 held K token by token: its bytes must not be read as pairs
        data[4] = 1
    else:
        wanted[1] = (2, tuple(range(1, 17)))  # same hash, other tokens: not the block asked for
    open(path, "wb").write(data)
    loaded = read_back(store, wanted)
    assert [b.block_hash for b in loaded] == [1]  # the prefix stops at the bad block
    assert store.stats.corrupt_files == 1 and not os.path.exists(path) and not store.contains(2)
    store.close()


def test_a_full_disk_costs_the_copies_counted_and_nothing_else(tmp_path, monkeypatch):
    import errno

    import engine.kv_disk

    store = make_store(tmp_path)
    store.save(1, tuple(range(16)), random_block(1))
    store.flush()

    class FullDisk:
        def __init__(self, path, mode):
            self.path = path
            open(path, mode).close()  # the temporary file is made, then the write fails

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine.kv_disk, "open", FullDisk, raising=False)
    for h in (2, 3):
        store.save(h, tuple(range(h, h + 16)), random_block(h))
    store.flush()
    assert store.stats.dropped_writes == 2 and store.stats.blocks == 1  # counted; the old block kept
    assert not store.contains(2) and not [f for f in os.listdir(store.folder) if f.endswith(".tmp")]
    monkeypatch.undo()  # space again: the tier goes on
    store.save(2, tuple(range(2, 18)), random_block(2))
    store.flush()
    assert store.contains(2) and store.stats.blocks == 2
    store.close()


@pytest.mark.parametrize("folder", ["/proc/pagedchat-kv", "a file"])
def test_an_unusable_kv_disk_folder_stops_the_command_at_once_with_its_name(tmp_path, folder):
    from app import parse_args
    from engine.config import config_from_args

    if folder == "a file":
        folder = str(tmp_path / "not-a-folder")
        open(folder, "w").close()
    with pytest.raises(ValueError, match=f"--kv-disk {folder}: cannot create it"):
        config_from_args(parse_args(["--kv-disk", folder]))


def test_clear_forgets_written_and_queued_blocks(tmp_path):
    store = make_store(tmp_path)
    store.save(1, tuple(range(16)), random_block(1))
    store.flush()
    store.save(2, tuple(range(16)), random_block(2))  # maybe still queued when the reset comes
    store.clear()
    store.flush()
    assert store.stats.blocks == 0 and not store.contains(1) and not store.contains(2)
    assert not [f for f in os.listdir(store.folder) if f.endswith(".kv")]
    store.close()


def test_size_bound_evicts_least_recently_used(tmp_path):
    probe = make_store(tmp_path / "probe")
    probe.save(1, tuple(range(16)), random_block(1))
    probe.flush()
    file_bytes = probe.stats.bytes
    probe.close()
    store = make_store(tmp_path, capacity=3 * file_bytes)
    for h in (1, 2, 3):
        store.save(h, tuple(range(16)), random_block(h))
    store.flush()
    read_back(store, [(1, tuple(range(16)))])  # 1 is now the most recently used
    store.save(4, tuple(range(16)), random_block(4))
    store.flush()
    assert not store.contains(2) and all(store.contains(h) for h in (1, 3, 4))
    assert store.stats.bytes <= 3 * file_bytes
    store.close()


def test_other_models_do_not_share_blocks(tmp_path, tiny_model):
    _, model = tiny_model("llama")
    a = model_identity(model, torch.bfloat16, "none", 16)
    assert a == model_identity(model, torch.bfloat16, "none", 16)
    assert len({a, model_identity(model, torch.bfloat16, "none", 32), model_identity(model, torch.float32, "none", 16),
                model_identity(model, torch.bfloat16, "int8", 16)}) == 4
    make_store(tmp_path, identity=a).save(5, tuple(range(16)), random_block(5))
    other = make_store(tmp_path, identity=b"x" * 16)
    assert not other.contains(5)
    other.close()


def test_blocks_registered_for_unwritten_tokens_lose_their_hash():
    """A request preempted in the step that scheduled it: its new blocks were never written."""
    kv = KVCacheManager(num_blocks=8, block_size=16, enable_caching=True)
    req = Request("a", list(range(40)), SamplingParams())
    assert kv.allocate_slots(req, 40)
    assert len(kv.pool.cached) == 2
    kv.free(req, written_tokens=16)  # only the first block was written
    assert list(kv.pool.cached) == req.block_hashes[:1]
    kv.pool.check_integrity()


# ---- through the engine (fp32: in bf16 a cache hit and a recompute may round differently) ---
def conversation(llm: LLM, turns: int) -> list[int]:
    """Raw token ids, each turn the whole history plus a few new tokens; returns the last history."""
    history = list(range(100, 140))
    for t in range(turns):
        out = llm.generate([history], GREEDY)[0]
        history = history + out.outputs[0].token_ids + list(range(200 + 10 * t, 207 + 10 * t))
    return history


def test_a_restarted_engine_loads_the_whole_stored_conversation(tmp_path, tiny_model):
    path, _ = tiny_model("llama")
    first = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32")
    history = conversation(first, 3)
    first.engine.close()
    restarted = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32")
    out = restarted.generate([history], GREEDY)[0]
    stored = len(history) - 7 - 1  # the last turn's prompt and reply, less the reply's last token
    assert out.num_cached_tokens == stored // 16 * 16
    stats = restarted.get_stats()
    assert stats.kv_disk_hits == out.num_cached_tokens and stats.kv_disk_read_bytes > 0
    restarted.engine.check_integrity()
    fresh = LLM(path, num_kv_blocks=64, dtype="float32")  # no disk tier: recompute
    assert fresh.generate([history], GREEDY)[0].outputs[0].token_ids == out.outputs[0].token_ids
    restarted.engine.close()


def test_evicted_blocks_come_back_from_disk_with_the_same_greedy_output(tmp_path, tiny_model):
    """A pool too small to keep two conversations: the first one's blocks are evicted, then read back."""
    path, _ = tiny_model("llama")
    results = {}
    for disk in (None, str(tmp_path)):
        llm = LLM(path, kv_disk=disk, num_kv_blocks=24, dtype="float32")
        a = list(range(100, 260))
        first = llm.generate([a], GREEDY)[0].outputs[0].token_ids
        llm.generate([list(range(300, 520))], GREEDY)  # pushes a's blocks out of the pool
        if disk:
            llm.engine.kv.disk.flush()
        out = llm.generate([a + first + [7, 8, 9]], GREEDY)[0]
        results[disk is not None] = (first, out.outputs[0].token_ids, out.num_cached_tokens)
        llm.engine.check_integrity()
        llm.engine.close()
    assert results[True][:2] == results[False][:2]
    assert results[True][2] == (160 + 24 - 1) // 16 * 16 > results[False][2]  # the evicted tail came from disk


def test_a_corrupted_file_is_recomputed_not_trusted(tmp_path, tiny_model):
    path, _ = tiny_model("llama")
    first = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32")
    history = conversation(first, 2)
    first.engine.close()
    victim = first.engine.kv.disk._path(block_of(history, 3))
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 0x55
    open(victim, "wb").write(data)
    restarted = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32")
    out = restarted.generate([history], GREEDY)[0]
    assert out.num_cached_tokens == 3 * 16  # blocks 0-2 from disk, the rest recomputed
    assert restarted.get_stats().kv_disk_corrupt_files == 1
    fresh = LLM(path, num_kv_blocks=64, dtype="float32")
    assert fresh.generate([history], GREEDY)[0].outputs[0].token_ids == out.outputs[0].token_ids
    restarted.engine.close()


def block_of(tokens: list[int], i: int) -> int:
    """The chain hash of block i of these tokens."""
    from engine.block_pool import hash_block

    h = None
    for k in range(i + 1):
        h = hash_block(h, tokens[k * 16:(k + 1) * 16])
    return h


@pytest.fixture
def slow_disk(tmp_path, tiny_model):
    """(a restarted engine whose disk reads wait for `gate`, a stored conversation, gate)."""
    path, _ = tiny_model("llama")
    first = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32")
    history = conversation(first, 2)
    first.engine.close()
    engine = LLM(path, kv_disk=str(tmp_path), num_kv_blocks=64, dtype="float32").engine
    gate, read_block = threading.Event(), engine.kv.disk._read_block
    engine.kv.disk._read_block = lambda *a: gate.wait(30) and read_block(*a)  # the disk is slow today
    yield engine, history, gate
    gate.set()
    engine.close()


def test_a_request_waiting_for_disk_does_not_hold_up_others(slow_disk):
    engine, history, gate = slow_disk
    returning = engine.add_request(history, GREEDY)
    other = engine.add_request(list(range(50, 90)), SamplingParams(temperature=0, max_tokens=4))
    finished = {}
    while other not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert returning not in finished and returning in engine.scheduler.loading
    assert engine.get_stats().num_waiting == 1
    gate.set()
    while returning not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[returning].num_cached_tokens > 0
    engine.check_integrity()


def test_aborting_a_request_while_its_blocks_load_leaks_nothing(slow_disk):
    engine, history, gate = slow_disk
    store = engine.kv.disk
    rid = engine.add_request(history, GREEDY)
    engine.step()
    assert rid in engine.scheduler.loading
    engine.abort_request(rid)
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    gate.set()
    while store._reading:  # the read in flight ends and its blocks are dropped
        store.wait_for_load(timeout=0.1)
    assert not store._loaded and not store._cancelled and not engine.has_unfinished_requests()
    engine.check_integrity()


# ---- settings and surfaces ----------------------------------------------------------------
def test_settings():
    assert parse_bytes("512M") == 512 * 2**20 and parse_bytes("4GiB") == 4 * 2**30
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(kv_disk="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        EngineConfig(kv_disk="/tmp/x", kv_disk_bytes=0)


def test_metrics_and_panel_show_the_tier():
    stats = EngineStats(kv_disk_capacity_bytes=2**30, kv_disk_blocks=7, kv_disk_bytes=7 * 2**20, kv_disk_hits=96,
                        kv_disk_queries=128, kv_disk_read_bytes=3 * 2**20, kv_disk_written_bytes=9 * 2**20)
    metrics = EngineMetrics("m")
    metrics.on_step(stats, stepped=False)
    text = metrics.exposition().decode()
    for line in ('pagedchat:kv_disk_blocks{model_name="m"} 7.0', 'vllm:external_prefix_cache_hits_total{model_name="m"} 96.0',
                 'vllm:external_prefix_cache_queries_total{model_name="m"} 128.0',
                 'pagedchat:kv_disk_written_bytes_total{model_name="m"} 9.437184e+06'):
        assert line in text
    html = disk_line(stats.__dict__)
    assert "<b id='kv-disk-blocks'>7</b>" in html and "96</b>/128 tokens" in html
    assert "off" in disk_line(EngineStats().__dict__)
