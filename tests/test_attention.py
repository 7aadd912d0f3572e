"""Paged attention (decode rows and prefill chunks): our C kernel and the torch path (the one CUDA
uses) against a plain softmax(QK^T)V over each sequence's contiguous K/V; the other C kernels against
the torch ops they replace."""
import shutil

import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, PagedAttention
from engine.config import cpu_flags, knobs
from engine.kv_layout import key_pairs, key_rows


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
@pytest.mark.parametrize("D", [64, 80])  # 64: the kernel's vectorised paths (bf16 or fp32); 80: its generic one
@pytest.mark.parametrize("H, Hkv", [(8, 2), (9, 3), (6, 6), (14, 2)])  # 4, 3, 1, 7 (4 + 3) query rows per kv head
@pytest.mark.parametrize("window", [None, 5, 21])  # sliding windows that start inside a block
def test_paged_decode_matches_reference(dtype, tol, block_size, path, D, H, Hkv, window, monkeypatch):
    if path == "kernel" and not cpu_kernels.available():
        pytest.skip("no C compiler")
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 40
    attn = PagedAttention(H, Hkv, D, D ** -0.5, window)
    attn.k_cache = key_pairs(torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype))
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
    qkv = torch.randn(len(lens), (H + 2 * Hkv) * D, generator=gen).to(dtype)
    q = qkv[:, :H * D].view(len(lens), H, D)  # strided rows, as the fused projection leaves them
    out = attn._decode(q, meta)
    for i, n in enumerate(lens):
        first = max(0, n - window) if window else 0  # the last `window` tokens, the row's own included
        slots = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(first, n)])
        keys = key_rows(attn.k_cache).view(-1, Hkv, D)[slots]
        values = attn.v_cache.view(-1, Hkv, D)[slots]
        ref = reference(q[i], keys, values, D ** -0.5)
        assert (out[i].double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_the_kernels_build_wherever_a_c_compiler_is_found():
    """A compile error must fail the suite: else every kernel test skips, the engine falls back to torch, and
    the run is green and several times slower. The build's paths follow the CPU's flags."""
    if knobs().no_kernels or shutil.which(knobs().cc) is None:
        pytest.skip("no C compiler, or PAGEDCHAT_NO_KERNELS")
    assert cpu_kernels.available(), "the C kernels did not build: see the pagedchat.kernels warning"
    flags = cpu_flags()
    assert cpu_kernels.has("quant_f32") == ({"avx2", "fma"} <= flags)
    assert cpu_kernels.has("quant_bf16") == ({"avx512_bf16", "avx512_vnni"} <= flags)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_row_is_attended_the_same_alone_and_in_a_batch(dtype, block_size):
    """The kernel's rows are each sequence's own (with AMX, a prompt chunk's rows share tiles): a decode
    row, and each row of a 7-row prompt chunk over its own prefix, gives the same bits alone as in a batch
    with the others, and the chunk's rows match the reference."""
    gen = torch.Generator().manual_seed(block_size)
    attn = PagedAttention(9, 3, 64, 0.125)
    attn.k_cache = key_pairs(torch.randn(16, block_size, 3, 64, generator=gen).to(dtype))
    attn.v_cache = torch.randn(16, block_size, 3, 64, generator=gen).to(dtype)
    blocks = torch.randperm(16, generator=gen)
    chunk_end = 2 * block_size + 4  # the chunk's 7 rows cross a block boundary
    lens = torch.tensor([2 * block_size + 3, 5] + list(range(chunk_end - 6, chunk_end + 1)) + [3 * block_size])
    table = torch.stack([blocks[:3], blocks[3:6]] + [blocks[6:9]] * 7 + [blocks[9:12]])
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    out = attn._decode(q, AttentionMetadata(torch.empty(0, dtype=torch.long), 2, table, lens))
    for i in range(len(lens)):
        alone = attn._decode(q[i:i + 1], AttentionMetadata(torch.empty(0, dtype=torch.long), 1, table[i:i + 1],
                                                           lens[i:i + 1]))
        assert torch.equal(alone[0], out[i]), i
        slots = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(lens[i])])
        ref = reference(q[i], key_rows(attn.k_cache).view(-1, 3, 64)[slots], attn.v_cache.view(-1, 3, 64)[slots],
                        0.125)
        assert (out[i].double() - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_kv_store_writes_the_slots_index_copy_would(dtype, path, monkeypatch):
    """Both ways of storing (the C kernel; index writes on CUDA) put each token's K and V where the
    readers (key_rows, the V pool's rows) find it."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    store, calls = cpu_kernels.kv_store, []
    monkeypatch.setattr(cpu_kernels, "kv_store", lambda *a: calls.append(1) or store(*a))
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    gen = torch.Generator().manual_seed(1)
    attn = PagedAttention(9, 3, 64, 0.125)
    attn.k_cache, attn.v_cache = torch.zeros(6, 3, 32, 16, 2, dtype=dtype), torch.zeros(6, 16, 3, 64, dtype=dtype)
    # enough tokens for the kernel to split them over its threads, neighbours in one block among them
    slots = torch.tensor([17, 3, 95, 40, 41] + list(range(48, 60)) + [7, 90, 33])
    T = len(slots)
    qkv = torch.randn(T, 15 * 64, generator=gen).to(dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(T, 3, 64), qkv[:, 12 * 64:].view(T, 3, 64)  # strided views
    attn._store(k, v, slots)
    assert bool(calls) == (path == "kernel")  # the C path reads the strided views in place
    expected_k, expected_v = torch.zeros(96, 3, 64, dtype=dtype), torch.zeros(96, 3, 64, dtype=dtype)
    expected_k.index_copy_(0, slots, k)
    expected_v.index_copy_(0, slots, v)
    assert torch.equal(key_rows(attn.k_cache).view(96, 3, 64), expected_k)
    assert torch.equal(attn.v_cache.view(96, 3, 64), expected_v)
    assert torch.equal(attn.k_cache[1, :, :, 1].reshape(3, 64), k[0])  # slot 17: block 1, pairs of position 1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 2), (6, 6)])  # GQA and plain multi-head
@pytest.mark.parametrize("D", [32, 64, 128])  # 64, 128: our prefix kernel in bf16 where the CPU has it
def test_shared_prefix_cascade_matches_reference(dtype, tol, block_size, heads, D, monkeypatch):
    """Six decodes share three leading blocks (one of them only two: it branches off), two share
    nothing; ragged lengths. The cascade (prefix once as a matrix product + kernel suffix, merged)
    must equal plain attention over each sequence's whole K/V."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from engine import cascade
    from engine.cascade import find_shared_prefix

    monkeypatch.setattr(cascade, "MIN_SHARING_ROWS", 4)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 16)
    calls = []
    kernel = cpu_kernels.prefix_attention
    monkeypatch.setattr(cpu_kernels, "prefix_attention", lambda *a: calls.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(1)
    (H, Hkv), num_blocks = heads, 80
    attn = PagedAttention(H, Hkv, D, D ** -0.5)
    attn.k_cache = key_pairs(torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype))
    attn.v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    perm = iter(torch.randperm(num_blocks, generator=gen).tolist())
    prefix = [next(perm) for _ in range(3)]
    tables, lens = [], []
    for own_blocks, tail in ((1, 1), (2, 7), (1, block_size), (4, 3), (1, 5), (2, 9)):  # sharing rows
        tables.append(prefix + [next(perm) for _ in range(own_blocks)])
        lens.append((len(tables[-1]) - 1) * block_size + tail)
    tables.append(prefix[:2] + [next(perm) for _ in range(2)])  # shares two blocks only
    lens.append(4 * block_size)
    for n in (5, 2 * block_size + 1):  # no sharing
        tables.append([next(perm) for _ in range(-(-n // block_size))])
        lens.append(n)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    hashes = [list(range(len(t))) for t in tables]  # stand-ins: only the shared rows' first two are read
    shared = find_shared_prefix(table, seq_lens, block_size, hashes)
    assert shared is not None and shared.block_ids.tolist() == prefix[:2]  # the common run of the 7 sharing rows
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), table, seq_lens, shared=shared)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    out = attn._decode(q, meta)
    assert out.dtype == dtype and torch.equal(attn._decode(q, meta), out)  # reused operands: the same result
    assert bool(calls) == cpu_kernels.prefix_kernel(dtype, D, 2 * block_size)
    for i, n in enumerate(lens):
        slots = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(n)])
        keys, values = key_rows(attn.k_cache).view(-1, Hkv, D)[slots], attn.v_cache.view(-1, Hkv, D)[slots]
        ref = reference(q[i], keys, values, D ** -0.5)
        assert (out[i].double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item()), i


@pytest.mark.parametrize("D, H, Hkv", [(64, 9, 3), (64, 4, 4), (128, 8, 2), (128, 14, 2)])
@pytest.mark.parametrize("S", [1, 7, 17, 40])  # S * G query vectors: across tiles of 8 and 6, tasks of 48
@pytest.mark.parametrize("P", [16, 48, 304])  # one token vector, an odd count of them, a system prompt
def test_prefix_kernel_matches_reference(D, H, Hkv, S, P):
    """Our prefix kernel (csrc/prefix_attention.c) alone: every row's queries against the prefix,
    normalised outputs and log-sum-exps, against fp64; q rows strided as the fused projection leaves them."""
    if not cpu_kernels.prefix_kernel(torch.bfloat16, D, P):
        pytest.skip("no AVX-512 BF16 on this CPU")
    from engine.cascade import prefix_attention, prefix_operands

    gen = torch.Generator().manual_seed(S * P + D)
    k_blocks = torch.randn(P // 16, 16, Hkv, D, generator=gen).bfloat16()
    v_blocks = torch.randn(P // 16, 16, Hkv, D, generator=gen).bfloat16()
    qkv = (3 * torch.randn(S, (H + 2 * Hkv) * D, generator=gen)).bfloat16()
    q = qkv[:, :H * D].view(S, H, D)
    keys, values = prefix_operands(key_pairs(k_blocks), v_blocks)  # from the pool's layouts
    out, lse = prefix_attention(q, keys, values, D ** -0.5, threads=2)
    G = H // Hkv
    k = k_blocks.reshape(P, Hkv, D).double().repeat_interleave(G, 1)
    v = v_blocks.reshape(P, Hkv, D).double().repeat_interleave(G, 1)
    scores = torch.einsum("shd,phd->shp", q.double(), k) * D ** -0.5
    assert (lse.double() - scores.logsumexp(-1)).abs().max().item() < 1e-3
    ref = torch.einsum("shp,phd->shd", scores.softmax(-1), v)
    assert (out.double() - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())


def test_no_shared_prefix_when_too_few_share_or_a_sequence_is_inside_it(monkeypatch):
    from engine import cascade
    from engine.cascade import find_shared_prefix

    monkeypatch.setattr(cascade, "MIN_SHARING_ROWS", 4)
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 16)
    table = torch.tensor([[3, 4, 5], [3, 4, 6], [3, 4, 7], [3, 9, 8]])
    hashes = [[10, 11, 12]] * 4
    assert find_shared_prefix(table, torch.tensor([40, 40, 40, 40]), 16, hashes).block_ids.tolist() == [3]
    assert find_shared_prefix(table[:3], torch.tensor([40, 40, 40]), 16, hashes[:3]) is None  # fewer than 4 rows
    assert find_shared_prefix(table, torch.tensor([40, 40, 40, 40]), 16, []) is None  # content unknown
    # a sequence whose last token is in the first block keeps that block for itself
    assert find_shared_prefix(table, torch.tensor([40, 40, 16, 40]), 16, hashes) is None
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 32)  # a one-block prefix is too short to pay
    assert find_shared_prefix(table, torch.tensor([40, 40, 40, 40]), 16, hashes) is None


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 576), (64, 576), (7, 9, 64)])
def test_rms_norm_kernel_matches_transformers_arithmetic(dtype, tol, shape, monkeypatch):
    """The C RMSNorm (engine/csrc/rms_norm.c) against the torch ops it replaces: fp32 within
    rounding of a different summation order, bf16 within one bf16 step (~0.4% relative)."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from engine.layers import RMSNorm

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
        fast = norm(x)
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
        ref = norm(x)
    assert fast.dtype == dtype and fast.shape == x.shape
    assert ((fast.double() - ref.double()).abs() <= tol * ref.double().abs().clamp(min=1.0)).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 40])
def test_the_q_and_k_norms_read_their_heads_inside_the_qkv_output(dtype, tol, tokens, monkeypatch):
    """Qwen3's q/k norms over views of a qkv output (heads contiguous, tokens strided) take the C kernel,
    each head normalised alone, the view untouched: torch's numbers within rounding."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from engine.layers import RMSNorm

    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=gen) * 3).to(dtype)
    q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    before = qkv.clone()
    norm = RMSNorm(64, 1e-6).to(dtype)
    calls, heads, rows = [], cpu_kernels.rms_norm_heads, cpu_kernels.rms_norm  # one token's view is contiguous
    monkeypatch.setattr(cpu_kernels, "rms_norm_heads", lambda *a: calls.append(1) or heads(*a))
    monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *a: calls.append(1) or rows(*a))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        fast = [norm(q), norm(k)]
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
        ref = [norm(q), norm(k)]
    assert len(calls) == 2 and torch.equal(qkv, before)
    for f, r in zip(fast, ref):
        assert f.shape == r.shape and f.is_contiguous()
        assert ((f.double() - r.double()).abs() <= tol * r.double().abs().clamp(min=1.0)).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (5, 3, 96)])
def test_silu_and_mul_kernel_matches_torch(dtype, tol, shape, monkeypatch):
    """The C SiLU·mul (engine/csrc/silu_and_mul.c) against torch's ops: fp32 within rounding,
    bf16 within one bf16 step."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from engine.layers import SiluAndMul

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    fast = SiluAndMul()(x)
    monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    ref = SiluAndMul()(x)
    assert fast.dtype == dtype and fast.shape == ref.shape == (*shape[:-1], shape[-1] // 2)
    assert ((fast.double() - ref.double()).abs() <= tol * ref.double().abs().clamp(min=1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_and_rms_norm_equal_the_two_torch_ops(dtype, monkeypatch):
    """norm(x, residual) adds into the residual in place and normalises the sum: the same numbers
    as torch's add then the norm (the sum rounded to the dtype first, as transformers does)."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from engine.layers import RMSNorm

    gen = torch.Generator().manual_seed(4)
    x, residual = ((torch.randn(16, 576, generator=gen) * 3).to(dtype) for _ in range(2))
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
        ref_sum = x + residual
        ref = norm(ref_sum)
        fast, fast_sum = norm(x, residual.clone())
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
        slow, slow_sum = norm(x, residual.clone())
    assert torch.equal(fast_sum, ref_sum) and torch.equal(slow_sum, ref_sum)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for out in (fast, slow):  # ref itself came from the kernel's plain norm
        assert ((out.double() - ref.double()).abs() <= tol * ref.double().abs().clamp(min=1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_equals_the_torch_ops_on_strided_qkv_views(dtype, monkeypatch):
    """The C rotary (engine/csrc/rotary.c) rotates q and k in place inside the fused qkv output and
    gives torch's numbers: bf16 rounded at the same points, fp32 within rounding."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    from transformers import LlamaConfig

    from engine.layers import RotaryEmbedding

    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), 64, 1024)
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(7, (9 + 3 + 3) * 64, generator=gen) * 2).to(dtype)
    positions = torch.tensor([0, 1, 2, 500, 1023, 17, 3])
    q, k = qkv[:, :576].view(7, 9, 64), qkv[:, 576:768].view(7, 3, 64)
    q_ref, k_ref, v_before = q.clone(), k.clone(), qkv[:, 768:].clone()
    fast_q, fast_k = rotary(positions, q, k)
    assert fast_q.data_ptr() == qkv.data_ptr()  # in place, in the qkv buffer
    monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    ref_q, ref_k = rotary(positions, q_ref, k_ref)
    for fast, ref in ((fast_q, ref_q), (fast_k, ref_k)):
        if dtype == torch.bfloat16:
            assert torch.equal(fast, ref)
        else:
            assert torch.allclose(fast, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 768:], v_before)  # v, beside them in the buffer, untouched


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cached", [0, 37])  # a first chunk, and one over cached tokens
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_chunk_matches_reference(dtype, tol, block_size, cached, window):
    """A prefill chunk attends causally: token i of the chunk sees the cached tokens (read through
    its block table) and the chunk's tokens up to itself."""
    from engine.attention import PrefillSeq

    gen = torch.Generator().manual_seed(6)
    H, Hkv, D, num_blocks, q_len = 9, 3, 64, 24, 21
    ctx = cached + q_len
    attn = PagedAttention(H, Hkv, D, D ** -0.5, window)
    attn.k_cache = key_pairs(torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype))
    attn.v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[:-(-ctx // block_size)]
    slots = torch.tensor([int(blocks[t // block_size]) * block_size + t % block_size for t in range(ctx)])
    keys, values = key_rows(attn.k_cache).view(-1, Hkv, D)[slots], attn.v_cache.view(-1, Hkv, D)[slots]
    q = torch.randn(q_len, H, D, generator=gen).to(dtype)
    out = attn._prefill(q, keys[cached:], values[cached:], PrefillSeq(0, q_len, ctx, blocks))
    for i in range(q_len):
        first = max(0, cached + i + 1 - window) if window else 0
        ref = reference(q[i], keys[first:cached + i + 1], values[first:cached + i + 1], D ** -0.5)
        assert (out[i].double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item()), i
