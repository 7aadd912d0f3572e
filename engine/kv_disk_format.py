"""One disk-tier file: a header (magic, model identity, block hash, token count, payload size,
CRC-32 over tokens and payload), the block's token ids as int32, then K and V of every layer.
And the model identity that names a folder of them."""
from __future__ import annotations

import hashlib
import os
import struct
import time
import zlib
from array import array

import torch

MAGIC = b"PCKV\x02\x00\x00\x00"  # 2: K in dimension pairs (kv_layout.kv_cache_shapes); older files miss
HEADER = struct.Struct("<8s16s16sIQI")


def model_identity(model: torch.nn.Module, dtype: torch.dtype, quantization: str, block_size: int) -> bytes:
    """16 bytes naming what a block's K/V depends on: every weight tensor's name, shape, dtype and a
    strided sample of its values (read in memory, so a renamed file keeps its cache), plus dtype,
    quantization and block size."""
    h = hashlib.blake2b(f"{type(model).__name__}|{dtype}|{quantization}|{block_size}".encode(), digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 512)][:512].contiguous().cpu()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.digest()


def encode_block(identity: bytes, block_hash: int, token_ids: tuple[int, ...], kv: torch.Tensor) -> list:
    """The file's parts, to write in order (the payload is a view of `kv`, not a copy)."""
    tokens = array("i", token_ids).tobytes()
    payload = kv.view(torch.uint8).numpy()
    crc = zlib.crc32(payload, zlib.crc32(tokens))
    header = HEADER.pack(MAGIC, identity, block_hash.to_bytes(16, "little"), len(token_ids), payload.nbytes, crc)
    return [header, tokens, payload]


def decode_block(data: memoryview, identity: bytes, block_hash: int, token_ids: tuple[int, ...],
                 dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The block's K/V [2, *shape], or None if any check fails: magic, identity, hash, sizes, CRC,
    and the token ids asked for."""
    if len(data) < HEADER.size:
        return None
    magic, stored_identity, stored_hash, num_tokens, payload_bytes, crc = HEADER.unpack_from(data)
    tokens_end = HEADER.size + 4 * num_tokens
    expected_payload = 2 * torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if (magic != MAGIC or stored_identity != identity or stored_hash != block_hash.to_bytes(16, "little")
            or payload_bytes != expected_payload or len(data) != tokens_end + payload_bytes):
        return None
    tokens, payload = data[HEADER.size:tokens_end], data[tokens_end:]
    stored_tokens = array("i")
    stored_tokens.frombytes(tokens)
    if zlib.crc32(payload, zlib.crc32(tokens)) != crc or tuple(stored_tokens) != tuple(token_ids):
        return None
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(2, *shape)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def file_age(entry: os.DirEntry) -> float:
    """Seconds since a directory entry was last written (0 if it is gone)."""
    try:
        return time.time() - entry.stat().st_mtime
    except OSError:
        return 0.0
