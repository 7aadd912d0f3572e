"""The KV tier on disk: every full KV block, one file each, found again by chain hash, so a block
evicted from the pool, or lost with the process, is read back instead of recomputed.

Layout: FOLDER/<model identity>/<block hash>.kv, where the identity covers the weights, dtype,
quantization and block size, so another model never reads these blocks (the file format is in
kv_disk_format.py). Files are written to a temporary name and renamed, so a crash leaves a whole
file or none; a file that fails any check (CRC, sizes, token ids) is a miss and is deleted.

Threads: the engine thread calls `save` (given a private copy, queued) and `load` (queued); a
writer thread and a reader thread do the file work, so a step never waits on the disk. The index
(hash -> file size, least recently used first) is shared under a lock. Several processes may share
one folder: each indexes the files present at its start and probes for newer ones on a miss.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.kv_disk_format import decode_block, encode_block, file_age, unlink

log = logging.getLogger("pagedchat.kv_disk")

MAX_PENDING_BYTES = 256 * 2**20  # copies waiting for the writer; past it a save is dropped (and counted)


def open_disk_tier(folder: str, capacity_bytes: int, identity: bytes, k_cache: torch.Tensor) -> DiskStore:
    """The store under `folder` for the model `identity` names (kv_disk_format.model_identity);
    k_cache: [layers, blocks, ...] (kv_layout.kv_cache_shapes)."""
    store = DiskStore(folder, identity, capacity_bytes, (k_cache.shape[0], k_cache[0, 0].numel()), k_cache.dtype)
    log.info("KV disk tier at %s: %d blocks (%.0f MiB) already there, bound %.0f MiB", store.folder,
             store.stats.blocks, store.stats.bytes / 2**20, capacity_bytes / 2**20)
    return store


@dataclass
class LoadedBlock:
    block_hash: int
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [2, layers, elements of one layer's block]: K then V, each in the pool's layout


@dataclass
class DiskStats:
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hit_blocks: int = 0  # blocks read back into the pool
    read_bytes: int = 0
    written_bytes: int = 0
    corrupt_files: int = 0
    dropped_writes: int = 0  # blocks not saved: the writer was behind, or the disk refused (full, read-only)


class DiskStore:
    """Files, index, size bound, and the two worker threads."""

    def __init__(self, folder: str, identity: bytes, capacity_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.identity = identity
        self.folder = os.path.join(folder, identity.hex())
        self.block_shape, self.dtype = block_shape, dtype
        self.payload_bytes = 2 * torch.Size(block_shape).numel() * torch.empty(0, dtype=dtype).element_size()
        self.stats = DiskStats(capacity_bytes=capacity_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> bytes on disk, oldest use first
        self._pending: set[int] = set()
        self._pending_bytes = 0
        self._loaded: dict[str, list[LoadedBlock]] = {}
        self._reading: set[str] = set()
        self._cancelled: set[str] = set()
        self._load_done = threading.Condition(self._lock)
        self._closed = False
        self._generation = 0  # bumped by clear(): older queued saves are not written
        os.makedirs(self.folder, exist_ok=True)
        self._scan()
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._work, args=(q, fn), name=f"pagedchat-kv-{name}", daemon=True)
                         for name, q, fn in (("write", self._writes, self._write), ("read", self._reads, self._read))]
        for t in self._threads:
            t.start()
        atexit.register(self.close)

    # ---- index ----------------------------------------------------------------------------
    def _path(self, block_hash: int) -> str:
        return os.path.join(self.folder, f"{block_hash:032x}.kv")

    def _scan(self) -> None:
        """Index the files already there, least recently used first; drop torn temporaries."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):  # torn by a crash (another live process's are recent)
                if file_age(entry) > 600:
                    unlink(entry.path)
            elif entry.name.endswith(".kv"):
                try:
                    st = entry.stat()
                    found.append((st.st_mtime, int(entry.name[:-3], 16), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
        self.stats.blocks, self.stats.bytes = len(self._index), sum(self._index.values())
        self._shrink()

    def contains(self, block_hash: int) -> bool:
        """On disk (or being written). A miss in the index probes the folder: another process may
        have written it since our scan."""
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return True
        try:
            size = os.stat(self._path(block_hash)).st_size
        except OSError:
            return False
        with self._lock:
            self._add(block_hash, size)
        return True

    def _add(self, block_hash: int, size: int) -> None:
        if block_hash not in self._index:
            self.stats.blocks += 1
            self.stats.bytes += size
        self._index[block_hash] = size
        self._index.move_to_end(block_hash)

    def _forget(self, block_hash: int, delete: bool) -> None:
        size = self._index.pop(block_hash, None)
        if size is not None:
            self.stats.blocks -= 1
            self.stats.bytes -= size
        if delete:
            unlink(self._path(block_hash))

    def _shrink(self) -> None:
        """Delete least recently used files until the folder fits its bound (lock held)."""
        while self.stats.bytes > self.stats.capacity_bytes and self._index:
            self._forget(next(iter(self._index)), delete=True)

    def clear(self) -> None:
        """Forget and delete every block of this model (the operator's cache reset); saves still
        queued are dropped too."""
        with self._lock:
            self._generation += 1
            for block_hash in list(self._index):
                self._forget(block_hash, delete=True)

    # ---- the engine thread's calls ----------------------------------------------------------
    def save(self, block_hash: int, token_ids: tuple[int, ...], kv: torch.Tensor) -> None:
        """Queue one block for writing; `kv` must be a private CPU copy."""
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return
            if self._pending_bytes + self.payload_bytes > MAX_PENDING_BYTES:
                self.stats.dropped_writes += 1
                return
            self._pending.add(block_hash)
            self._pending_bytes += self.payload_bytes
            generation = self._generation
        self._writes.put((block_hash, token_ids, kv, generation))

    def load(self, request_id: str, wanted: list[tuple[int, tuple[int, ...]]]) -> None:
        """Read these consecutive blocks (hash, token ids) in the background, stopping at the first
        one missing or corrupt; `take_loaded(request_id)` has them once `finished()` names it."""
        with self._lock:
            self._reading.add(request_id)
        self._reads.put((request_id, wanted))

    def finished(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def take_loaded(self, request_id: str) -> list[LoadedBlock] | None:
        with self._lock:
            return self._loaded.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request ended: drop its blocks, now or when the read in flight ends."""
        with self._lock:
            self._loaded.pop(request_id, None)
            if request_id in self._reading:
                self._cancelled.add(request_id)

    def wait_for_load(self, timeout: float) -> None:
        with self._load_done:
            if not self._loaded:
                self._load_done.wait(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(done)
        done.wait(timeout)

    def close(self) -> None:
        """Finish the queued writes and stop the threads (also run at interpreter exit)."""
        atexit.unregister(self.close)
        if not self._closed:
            self._closed = True
            self.flush()
            for q in (self._writes, self._reads):
                q.put(None)

    # ---- worker threads ---------------------------------------------------------------------
    def _work(self, jobs: queue.Queue, handle) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                handle(*job)
            except Exception:  # noqa: BLE001 - a disk fault costs a cache entry, never the engine
                log.exception("KV disk tier: %s failed", handle.__name__)

    def _write(self, block_hash: int, token_ids: tuple[int, ...], kv: torch.Tensor, generation: int) -> None:
        path, size = self._path(block_hash), 0
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # unique per writer, even in one process
        try:
            if generation != self._generation:
                return
            parts = encode_block(self.identity, block_hash, token_ids, kv)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
            size = sum(memoryview(p).nbytes for p in parts)
        except OSError as e:  # a full or read-only disk costs this block's copy, counted, nothing else
            log.warning("KV disk tier: could not write %s: %s", path, e)
            unlink(tmp)
            with self._lock:
                self.stats.dropped_writes += 1
        finally:
            with self._lock:
                self._pending.discard(block_hash)
                self._pending_bytes -= self.payload_bytes
                if size and generation != self._generation:  # cleared while it was being written
                    unlink(path)
                    size = 0
                if size:
                    self._add(block_hash, size)
                    self.stats.written_bytes += size
                    self._shrink()

    def _read(self, request_id: str, wanted: list[tuple[int, tuple[int, ...]]]) -> None:
        blocks = []
        try:
            for block_hash, token_ids in wanted:
                kv = self._read_block(block_hash, token_ids)
                if kv is None:
                    break
                blocks.append(LoadedBlock(block_hash, token_ids, kv))
        finally:
            with self._lock:
                self._reading.discard(request_id)
                if request_id in self._cancelled:
                    self._cancelled.discard(request_id)
                else:
                    self._loaded[request_id] = blocks
                self._load_done.notify_all()

    def _read_block(self, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
        except OSError:
            with self._lock:
                self._forget(block_hash, delete=False)
            return None
        kv = decode_block(memoryview(data)[:n], self.identity, block_hash, token_ids, self.dtype, self.block_shape)
        with self._lock:
            if kv is None:
                self.stats.corrupt_files += 1
                self._forget(block_hash, delete=True)
                log.warning("KV disk tier: %s failed its checks; deleted, it counts as a miss", path)
                return None
            self._add(block_hash, n)
            self.stats.hit_blocks += 1
            self.stats.read_bytes += n
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return kv
