"""Paged decode attention: our C kernel and the torch path (the one CUDA uses) against a plain
softmax(QK^T)V over each sequence's contiguous K/V."""
import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, PagedAttention


def reference(q, keys, values, scale):
    """q [H, D], keys/values [L, Hkv, D] -> [H, D], fp64."""
    G = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(G, dim=1).transpose(0, 1)
    p = ((q.double().unsqueeze(1) @ k.transpose(1, 2)) * scale).softmax(-1)
    return (p @ v).squeeze(1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_paged_decode_matches_reference(dtype, tol, block_size, path, monkeypatch):
    if path == "kernel" and not cpu_kernels.available():
        pytest.skip("no C compiler")
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, num_blocks = 8, 2, 32, 40
    attn = PagedAttention(H, Hkv, D, D ** -0.5)
    attn.k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    attn.v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    lens = [1, block_size, 3 * block_size + 5, 7]
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    tables, start = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[start:start + need])
        start += need
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), table, seq_lens)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    out = attn._decode(q, meta)
    for i, n in enumerate(lens):
        slots = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(n)])
        keys = attn.k_cache.view(-1, Hkv, D)[slots]
        values = attn.v_cache.view(-1, Hkv, D)[slots]
        ref = reference(q[i], keys, values, D ** -0.5)
        assert (out[i].double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
