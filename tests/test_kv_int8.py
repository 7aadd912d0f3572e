"""--kv-cache-dtype int8 (engine/kv_layout.py, csrc/attention_int8.h): the pools' bytes, the store, decode
attention over int8 blocks (our kernel and the torch path) against attention over the same blocks
dequantized, the cascade, and the engine end to end: greedy the same across batching, chunking, prefix
caching and preemption; the disk tier; twice the blocks in the same memory."""
import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.attention import AttentionMetadata, PagedAttention
from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.kv_layout import dequantize, int8_block_bytes, int8_views, key_rows, quantize_heads
from tests.test_attention import reference


def int8_layer(H, Hkv, D, block_size, num_blocks, window=None, seed=0):
    """A layer bound to int8 pools whose every slot holds random K/V rounded to int8."""
    gen = torch.Generator().manual_seed(seed)
    attn = PagedAttention(H, Hkv, D, D ** -0.5, window)
    size = int8_block_bytes(block_size, Hkv, D)
    attn.bind_cache(torch.zeros(num_blocks, size, dtype=torch.uint8), torch.zeros(num_blocks, size, dtype=torch.uint8),
                    int8=True)
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), Hkv, D, generator=gen) * torch.rand(len(slots), Hkv, 1, generator=gen) * 4
    v = torch.randn(len(slots), Hkv, D, generator=gen)
    attn._store_int8(k, v, slots, kernel=False)
    return attn, gen


def dense_rows(attn, dtype=torch.float32):
    """Every slot's K and V, dequantized: [slots, Hkv, D] each."""
    ids = torch.arange(attn.k_cache.shape[0])
    keys = key_rows(attn._key_blocks(ids, dtype)).reshape(-1, attn.num_kv_heads, attn.head_dim)
    return keys, attn._value_blocks(ids, dtype).reshape(-1, attn.num_kv_heads, attn.head_dim)


def test_rows_round_to_int8_with_a_scale_each():
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0
    q, scale = quantize_heads(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 3)
    assert int(q.abs().amax(dim=-1)[0, 0]) == 127 and float(scale[2, 1]) == 0 and not q[2, 1].any()
    back = q.float() * scale[..., None]
    assert ((back - x).abs() <= scale[..., None] / 2 + 1e-6 * x.abs()).all()  # half a step at most


def test_an_int8_pool_is_half_the_bytes_and_its_views_share_them():
    Hkv, D, bs = 3, 64, 16
    assert int8_block_bytes(bs, Hkv, D) * 2 == bs * Hkv * D * 2 + 8 * bs * Hkv  # bf16: 2 bytes a value
    pool = torch.zeros(4, int8_block_bytes(bs, Hkv, D), dtype=torch.uint8)
    values, scales = int8_views(pool, bs, Hkv, D, keys=True)
    assert values.shape == (4, Hkv, D // 4, bs, 4) and scales.shape == (4, Hkv, bs)
    values[2, 1, 5, 7, 1], scales[3, 2, 15] = -3, 0.5
    assert pool[2].view(torch.int8).tolist().count(-3) == 1 and pool[3].view(torch.float32).tolist().count(0.5) == 1
    assert (pool[:2] == 0).all()  # each block's bytes are its own


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_kernel_writes_what_the_torch_path_writes(dtype):
    """Both ways of storing put each token's rounded K and V and scales in the same bytes (the integers
    may differ by one where the kernel's x * (127 / max) rounds the other way)."""
    gen = torch.Generator().manual_seed(1)
    layers = []
    qkv = torch.randn(5, 15 * 64, generator=gen).to(dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)  # strided views
    slots = torch.tensor([17, 3, 95, 40, 41])
    for kernel in (True, False):
        attn = PagedAttention(9, 3, 64, 0.125)
        size = int8_block_bytes(16, 3, 64)
        attn.bind_cache(torch.zeros(6, size, dtype=torch.uint8), torch.zeros(6, size, dtype=torch.uint8), int8=True)
        attn._store_int8(k, v, slots, kernel)
        layers.append(attn)
    for (a, sa), (b, sb) in zip(layers[0].int8[1:], layers[1].int8[1:]):
        for x, y in ((a, b), (sa, sb)):
            assert (x.float() - y.float()).abs().max() <= (1 if x.dtype == torch.int8 else 1e-6 * y.abs().max())
    keys, values = dense_rows(layers[0])
    assert torch.allclose(keys[slots], k.float(), atol=0.03) and torch.allclose(values[slots], v.float(), atol=0.03)
    assert not keys[[0, 1, 2]].any()  # untouched slots stay empty


def int8_kernel_here(dtype: torch.dtype) -> bool:
    """Whether this build's kernel reads int8 pools for queries of `dtype`."""
    return cpu_kernels.has("quant_bf16" if dtype == torch.bfloat16 else "f32_attention")


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (8, 2, 128), (6, 6, 32), (14, 2, 64), (10, 2, 80)])
@pytest.mark.parametrize("window", [None, 21])
def test_decode_over_int8_blocks_matches_attention_over_them_dequantized(path, dtype, block_size, H, Hkv, D, window,
                                                                        monkeypatch):
    """bf16 queries take the AVX-512 BF16 + VNNI passes, fp32 ones the AVX2 passes (head_dim 80: a last
    chunk of 16 dimensions). The kernel rounds each query row to int8 too (its scores are integer dot
    products): it is held to that rounding within float error (a row's integer may differ by one where
    x * (127 / max) rounds the other way), and to the unrounded query within the rounding's 4e-2."""
    if path == "kernel" and not int8_kernel_here(dtype):
        pytest.skip("no int8 kernel for these queries on this CPU")
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    calls = []
    kernel = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    attn, gen = int8_layer(H, Hkv, D, block_size, 40, window)
    lens = [1, block_size, 3 * block_size + 5, 7]
    perm = torch.randperm(40, generator=gen).tolist()
    tables, start = [], 0
    for n in lens:
        tables.append(perm[start:start + -(-n // block_size)])
        start += len(tables[-1])
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), table, torch.tensor(lens))
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    out = attn._decode(q, meta)
    assert out.dtype == dtype
    assert [k["int8"] for k in calls] == ([(block_size, Hkv)] if path == "kernel" else [])
    keys, values = dense_rows(attn)
    rows, row_scales = quantize_heads(q)
    rounded = rows.double() * row_scales.double().unsqueeze(-1)
    for i, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        slots = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(first, n)])
        ref = reference(q[i], keys[slots], values[slots], D ** -0.5)
        bound = max(1.0, ref.abs().max().item())
        assert (out[i].double() - ref).abs().max().item() < 4e-2 * bound, i
        if path == "kernel":
            same_rounding = reference(rounded[i], keys[slots], values[slots], D ** -0.5)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-3  # bf16: the output's own rounding
            assert (out[i].double() - same_rounding).abs().max().item() < tol * bound, i


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cascade_reads_an_int8_prefix_once_for_all(dtype, monkeypatch):
    from engine import cascade
    from engine.cascade import find_shared_prefix

    monkeypatch.setattr(cascade, "MIN_SHARING_ROWS", 4)
    attn, gen = int8_layer(9, 3, 64, 16, 30)
    prefix = [4, 9, 1]
    tables = [prefix + [10 + i] for i in range(5)]
    lens = [3 * 16 + 1 + i for i in range(5)]
    table, seq_lens = torch.tensor(tables), torch.tensor(lens)
    shared = find_shared_prefix(table, seq_lens, 16, [list(range(4))] * 5, min_tokens=16)
    assert shared is not None
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 5, table, seq_lens, shared=shared)
    q = torch.randn(5, 9, 64, generator=gen).to(dtype)
    out = attn._decode(q, meta)
    keys, values = dense_rows(attn)
    for i, n in enumerate(lens):
        slots = torch.tensor([tables[i][t // 16] * 16 + t % 16 for t in range(n)])
        ref = reference(q[i], keys[slots], values[slots], 0.125)
        assert (out[i].double() - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item()), i


def test_a_kv_cache_dtype_that_does_not_exist_is_refused():
    with pytest.raises(ParameterError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 40, 17, 70, 33, 9, 52, 24))]


def greedy(llm, prompts=PROMPTS, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_greedy_is_the_same_however_the_engine_batches(tiny_model, dtype):
    """The engine with int8 blocks against itself one prompt at a time without a prefix cache: batched,
    in small chunks, with the prefix cache (a second pass reads the cached blocks), blocks of 32, and a
    pool so small that requests are preempted. Every path reads K/V as the pool holds them."""
    path, _ = tiny_model("llama")
    base = dict(dtype=dtype, kv_cache_dtype="int8", speculative_config="none")
    alone = LLM(path, num_kv_blocks=64, enable_prefix_caching=False, **base)
    expected = [greedy(alone, [p])[0] for p in PROMPTS]
    cached = LLM(path, num_kv_blocks=64, **base)
    assert greedy(cached) == expected
    assert greedy(cached) == expected and cached.engine.get_stats().prefix_cache_hits > 0
    assert greedy(LLM(path, num_kv_blocks=64, max_num_batched_tokens=16, **base)) == expected
    assert greedy(LLM(path, num_kv_blocks=32, block_size=32, **base)) == expected
    small = LLM(path, num_kv_blocks=14, **base)
    assert greedy(small) == expected and small.engine.get_stats().num_preemptions > 0
    assert small.engine.kv.pool.num_free == 14  # every block back


def test_int8_kv_holds_about_twice_the_blocks_and_stays_close_to_bf16(tiny_model):
    path, _ = tiny_model("llama")
    memory = 8 * 2**20
    plain = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=memory, speculative_config="none")
    int8 = LLM(path, dtype="bfloat16", kv_cache_memory_bytes=memory, kv_cache_dtype="int8", speculative_config="none")
    a, b = plain.engine.stats.kv_blocks_total, int8.engine.stats.kv_blocks_total
    head_dim = plain.engine.model.attention_layers()[0].head_dim
    assert b == memory // (memory // a * (head_dim + 4) // (2 * head_dim))  # (D + 4) bytes against 2D a value
    assert b > 1.5 * a
    agree = [x[0] == y[0] for x, y in zip(greedy(plain), greedy(int8))]
    assert sum(agree) >= 6  # the first token of most prompts (random weights: near-ties are common)


def test_the_disk_tier_keeps_int8_blocks_apart_and_reads_them_back(tiny_model, tmp_path):
    """Blocks written by an int8 engine come back into a new int8 engine (same greedy tokens, blocks read
    from disk), and a bf16 engine on the same folder never reads them."""
    path, _ = tiny_model("llama")
    opts = dict(dtype="bfloat16", num_kv_blocks=64, kv_disk=str(tmp_path), speculative_config="none")
    first = LLM(path, kv_cache_dtype="int8", **opts)
    expected = greedy(first)
    first.engine.close()
    second = LLM(path, kv_cache_dtype="int8", **opts)
    assert greedy(second) == expected
    assert second.get_stats().kv_disk_hits > 0
    second.engine.check_integrity()
    second.engine.close()
    other = LLM(path, **opts)
    greedy(other)
    assert other.get_stats().kv_disk_hits == 0
    other.engine.close()


def test_int8_blocks_dequantize_to_the_layout_of_bf16_ones():
    """K's quads [.., Hkv, D/4, bs, 4] come back as the bf16 pool's pairs [.., Hkv, D/2, bs, 2]."""
    values = torch.randint(-127, 128, (2, 3, 8, 16, 4), dtype=torch.int8)
    scales = torch.rand(2, 3, 16)
    rows = key_rows(dequantize(values, scales, True, torch.float32))  # [2, 16, 3, 32]
    assert torch.equal(rows[1, 9, 2, 20:24], values[1, 2, 5, 9].float() * scales[1, 2, 9])


def test_the_panel_says_the_pool_is_int8(tiny_model):
    from engine.snapshot import take_snapshot
    from ui.panel import memory_html

    path, _ = tiny_model("llama")
    for kv, shown in (("int8", True), ("auto", False)):
        snap = take_snapshot(LLM(path, num_kv_blocks=8, kv_cache_dtype=kv).engine)
        assert snap["memory"]["kv_cache_dtype"] == kv
        assert ("(int8)" in memory_html(snap)) == shown


def test_the_cache_config_metric_names_the_kv_dtype(tiny_model):
    """vLLM's vllm:cache_config_info (value 1) carries the pool's block size, dtype and block count."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from engine.async_llm import AsyncLLM
    from tests.serving import LiveServer

    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=32, kv_cache_dtype="int8", block_size=32))
    with LiveServer(llm) as server:
        text = httpx.get(f"{server.url}/metrics").text
    [info] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:cache_config_info"]
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "cache_dtype", "num_gpu_blocks")} == \
        {"block_size": "32", "cache_dtype": "int8", "num_gpu_blocks": "32"}
