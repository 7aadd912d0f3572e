"""Weight-only quantization: exact packing round trips, kernels against the dequantized weights,
GGUF blocks read as the file holds them, quantized models end to end."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, cpu_kernels
from engine.quant import cpu_matmul, packing
from engine.checkpoint.gguf import gguf_weights
from engine.checkpoint.quantized import Packed4
from engine.checkpoint.source import default_model_path
from engine.linear import DenseKernel, can_pack
from engine.quant.kernels import SMALL_M, Int4Weight, Int8Weight, quantize_int4, quantize_int8
from tests.kquants import q4_k_m_gguf, q8_0_gguf, rewritten_gguf
from tests.test_models import paged_logits


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_and_kernel(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(96, 256, generator=g)
    q, scales, zeros = quantize_int4(w, group)
    assert q.min() >= 0 and q.max() <= 15
    weight = Int4Weight(q, scales, zeros, group, torch.bfloat16)
    deq = weight.dequantize(q, scales, zeros)
    gidx = torch.arange(256) // group
    assert torch.equal(deq, (q.float() - 8) * scales[gidx].T + zeros[gidx].T)  # the convention, exactly
    assert (deq - w).abs().max() <= (scales.max() / 2 + 1e-6)  # round to nearest: half a step at most
    for m in (1, SMALL_M, weight.small_m, weight.small_m + 4):  # packed kernel rows, then the dense path
        x = torch.randn(m, 256, generator=g).bfloat16()
        assert rel(weight.matmul(x), F.linear(x.float(), deq)) < 2e-2  # packed rows may be int8 per 32 inputs


# Our kernels on this CPU by activation dtype (none: torch's kernels serve, tested above); each with
# its bound on the error against fp64: bf16 rows and outputs (8 bits of mantissa), fp32 (24).
OUR_KERNELS = [pytest.param(dtype, id=str(dtype)[6:]) for dtype in cpu_matmul.quant_matmul_dtypes()]
TOLERANCE = {torch.bfloat16: 2 ** -8, torch.float32: 2 ** -18}


def int8_rounding_bound(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """The most rounding x to int8 per 32 inputs (step max|x| / 127, half a step off at most) can move
    x @ deq^T: sum over each 32 inputs of half their step times |w|."""
    M, K = x.shape
    half_step = (x.double().reshape(M, K // 32, 32).abs().amax(-1) / 127 / 2).repeat_interleave(32, dim=1)
    return half_step @ deq.abs().T


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
@pytest.mark.parametrize("int8", [False, True], ids=["as-is", "int8-rows"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("n", [48, 80, 256])
def test_our_int4_kernel_against_fp64_and_batch_invariant(dtype, int8, group, n):
    """Every tile shape (up to 17 rows: each kernel's row chunks and their remainders over 1-4 column
    blocks, widened in registers or from a strip), against the dequantized weight in fp64 (scales
    as the kernel keeps them); and each row's result is bit-identical whatever the batch. bf16 rows
    as int8 per 32 inputs: within the rounding's own bound, and not equal to the bf16 kernel's
    (the int8 kernel really ran); fp32 rows likewise (AVX2's vpmaddubsw)."""
    g = torch.Generator().manual_seed(n + group)
    K = 256
    q, scales, zeros = quantize_int4(torch.randn(n, K, generator=g), group)
    packed, sz = packing.int4_pack(q, scales, zeros, dtype, int8)
    gidx = torch.arange(K) // group
    kept = scales.to(dtype).double(), zeros.to(dtype).double()
    deq = (q.double() - 8) * kept[0][gidx].T + kept[1][gidx].T
    x = (torch.randn(17, K, generator=g) * 3).to(dtype)
    x[3, 40:72] = 0  # a group of zeros: step 0
    matmul = lambda rows: cpu_matmul.int4_matmul(rows, packed, sz, group, int8)  # noqa: E731
    alone = torch.cat([matmul(x[i:i + 1]) for i in range(17)])
    for m in range(1, 18):
        y = matmul(x[:m])
        ref = x[:m].double() @ deq.T
        slack = int8_rounding_bound(x[:m], deq) if int8 else 0
        assert y.dtype == dtype and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= ref.abs() * TOLERANCE[dtype] + 1e-3 * ref.abs().max() + slack).all(), m
        assert torch.equal(y, alone[:m])
    if int8:
        as_is = cpu_matmul.int4_matmul(x, *packing.int4_pack(q, scales, zeros, dtype), group)
        assert ((as_is.double() - x.double() @ deq.T).abs() <= ref.abs() * TOLERANCE[dtype] + 1e-3 * ref.abs().max()).all()
        assert not torch.equal(alone, as_is)


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
@pytest.mark.parametrize("int8", [False, True], ids=["as-is", "int8-rows"])
@pytest.mark.parametrize("n", [48, 80, 112, 6400])
def test_our_int8_kernel_against_fp64_and_batch_invariant(dtype, int8, n):
    """As the 4-bit test, and from 32 rows (the int8 rows' tiles of 4 rows by 3 blocks, their leftovers;
    6400 columns: a thread's share over 512 KB, where the leftover rows take each block in place);
    the extremes of int8 (-128 too: AVX2's kernel multiplies its magnitude by the row's bytes with its sign,
    and 128 * 127 twice still fits a 16-bit word)."""
    g = torch.Generator().manual_seed(n)
    K = 192
    q, scales = quantize_int8(torch.randn(n, K, generator=g))
    q[0, :4] = torch.tensor([127, -127, -128, 0], dtype=torch.int8)  # the extremes, -128 included
    packed = packing.int8_pack(q, dtype, int8)
    deq = q.double() * scales.double()[:, None]
    x = (torch.randn(41, K, generator=g) * 3).to(dtype)
    x[2, 32:64] = 0  # a group of zeros: step 0
    matmul = lambda rows: cpu_matmul.int8_matmul(rows, packed, scales, int8)  # noqa: E731
    alone = torch.cat([matmul(x[i:i + 1]) for i in range(41)])
    for m in [*range(1, 12), 15, 30, 32, 35, 41]:
        y = matmul(x[:m])
        ref = x[:m].double() @ deq.T
        slack = int8_rounding_bound(x[:m], deq) if int8 else 0
        assert y.dtype == dtype and y.shape == (m, n)
        assert ((y.double() - ref).abs() <= ref.abs() * TOLERANCE[dtype] + 1e-3 * ref.abs().max() + slack).all(), m
        assert torch.equal(y, alone[:m])


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
def test_kernels_split_over_threads_give_the_same_bits_alone_and_from_concurrent_callers(dtype, monkeypatch):
    """Our thread pool (csrc/pool.c): one thread or four, and four Python threads calling at once
    (all but one find the pool busy and run their parts themselves), compute the same bits."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(5)
    q, scales, zeros = quantize_int4(torch.randn(512, 576, generator=g), 32)
    packed, sz = packing.int4_pack(q, scales, zeros, dtype)
    xs = [torch.randn(8, 576, generator=g).to(dtype) for _ in range(4)]
    monkeypatch.setattr(cpu_kernels, "_threads", 1)
    serial = [cpu_matmul.int4_matmul(x, packed, sz, 32) for x in xs]
    monkeypatch.setattr(cpu_kernels, "_threads", 4)
    assert all(torch.equal(cpu_matmul.int4_matmul(x, packed, sz, 32), y) for x, y in zip(xs, serial))

    def wrong_results(i: int) -> int:
        return sum(not torch.equal(cpu_matmul.int4_matmul(xs[i], packed, sz, 32), serial[i]) for _ in range(200))

    with ThreadPoolExecutor(4) as callers:
        assert sum(callers.map(wrong_results, range(4))) == 0


# The 4-bit kernels by the model's dtype: (rows as they are, rows rounded to int8).
INT4_KERNELS = {torch.bfloat16: ("int4_matmul", "int4_matmul_i8"), torch.float32: ("int4_matmul_f32", "int4_matmul_f32_i8")}


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
def test_the_engine_setting_picks_the_kernel_for_decode_rows(dtype, tiny_model, monkeypatch):
    """int8_activations (default on) sends a model's decode rows, and a small step's prompt rows, to the
    int8-row kernel (bf16 models on AVX-512 VNNI, fp32 ones on AVX2); off, decode rows to the kernel that
    takes them as they are; the greedy tokens agree at first."""
    path, _ = tiny_model("qwen2")
    # the linears' own kernel calls (the fused stack makes the same ones from C: tests/test_fused_layers.py)
    monkeypatch.setenv("PAGEDCHAT_NO_FUSED_LAYERS", "1")
    calls = []  # (kernel, rows)
    for name in INT4_KERNELS[dtype]:
        fn = getattr(cpu_kernels._lib, name)
        spy = lambda *a, fn=fn, name=name: calls.append((name, a[4])) or fn(*a)  # noqa: E731
        monkeypatch.setattr(cpu_kernels._lib, name, spy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        calls.clear()
        options = {} if on else {"int8_activations": False}
        llm = LLM(path, dtype=str(dtype)[6:], quantization="int4", num_kv_blocks=32, **options)
        tokens[on] = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
        assert {name for name, _ in calls} == {INT4_KERNELS[dtype][on]}
        assert (4 in {rows for _, rows in calls}) == on  # the prompt's 4 rows: packed with int8 rows only
        assert llm.engine.quantization_shown == ("int4, int8 rows" if on else "int4")  # what the panel shows
    assert tokens[True][:2] == tokens[False][:2]


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
def test_int8_rows_take_every_row_so_chunking_leaves_greedy_unchanged(dtype, tiny_model, monkeypatch):
    """4-bit layers with int8 rows keep no dense copy (even with AMX, its flag faked, unless
    dense_prompt_weights asks) and take all 450 rows of a prompt run in one step, so its greedy tokens
    equal those of the same prompt in chunks of 64; with AMX and dense_prompt_weights they keep the
    dense copy for large steps' prompt rows, without AMX they do not."""
    path, _ = tiny_model("qwen2")
    from engine.quant import methods

    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    monkeypatch.setenv("PAGEDCHAT_NO_FUSED_LAYERS", "1")  # the linears' own kernel calls, as above
    rows = []
    name = INT4_KERNELS[dtype][True]
    fn = getattr(cpu_kernels._lib, name)
    monkeypatch.setattr(cpu_kernels._lib, name, lambda *a: rows.append(a[4]) or fn(*a))
    prompt = [[(37 * i) % 400 + 20 for i in range(450)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for budget in (1024, 64):
        llm = LLM(path, dtype=str(dtype)[6:], quantization="int4", num_kv_blocks=64, max_num_batched_tokens=budget)
        assert llm.engine.model.model.layers[0].mlp.down_proj.kernel.dense is None
        tokens[budget] = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert 450 in rows and max(rows) == 450  # the whole prompt in one step, through the packed kernel
    assert tokens[1024] == tokens[64]
    amx = LLM(path, dtype=str(dtype)[6:], quantization="int4", num_kv_blocks=64, dense_prompt_weights=True)
    assert amx.engine.model.model.layers[0].mlp.down_proj.kernel.dense is not None
    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset())
    plain = LLM(path, dtype=str(dtype)[6:], quantization="int4", num_kv_blocks=64, dense_prompt_weights=True)
    assert plain.engine.model.model.layers[0].mlp.down_proj.kernel.dense is None


def test_int4_act_order_permutation_is_undone():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g)
    perm = torch.randperm(128, generator=g)
    q, scales, zeros = quantize_int4(w[:, perm], 32)  # groups over permuted inputs, as GPTQ act-order
    weight = Int4Weight(q, scales, zeros, 32, torch.bfloat16, perm=perm)
    deq = weight.dequantize(q, scales, zeros)
    assert (deq - w).abs().max() < scales.max()
    x = torch.randn(2, 128, generator=g).bfloat16()
    assert rel(weight.matmul(x), F.linear(x.float(), deq)) < 1e-2


@pytest.mark.skipif(not cpu_kernels.has("amx_bf16_tiles"), reason="no AMX-BF16 tiles here")
@pytest.mark.parametrize("group, perm", [(32, False), (128, True)])
def test_4bit_blocks_on_bf16_tiles_compute_the_dequantized_product_and_a_row_as_alone(group, perm):
    """The packed blocks widened to bf16 on AMX tiles (batch_invariant off) equal the dequantized weights'
    product (bf16 rounding), rows past a multiple of 16 included, each row as when alone."""
    g = torch.Generator().manual_seed(group)
    w = torch.randn(96, 256, generator=g)
    order = torch.randperm(256, generator=g) if perm else None
    q, scales, zeros = quantize_int4(w if order is None else w[:, order], group)
    weight = Int4Weight(q, scales, zeros, group, torch.bfloat16, perm=order)
    deq = weight.dequantize(q, scales, zeros)
    x = torch.randn(37, 256, generator=g).bfloat16()
    y = weight._tiles_matmul(x)
    assert y.shape == (37, 96) and rel(y, F.linear(x.float(), deq)) < 1e-2
    assert torch.equal(torch.cat([weight._tiles_matmul(x[i:i + 1]) for i in range(37)]), y)


def test_int8_round_trip_and_kernel():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 192, generator=g)
    q, scales = quantize_int8(w)
    weight = Int8Weight(q, scales, torch.bfloat16)
    assert (q.float() * scales[:, None] - w).abs().max() <= scales.max() / 2 + 1e-6
    for m in (1, SMALL_M + 3, weight.small_m + 1):  # packed kernel rows, then the dense path
        x = torch.randn(m, 192, generator=g).bfloat16()
        assert rel(weight.matmul(x), F.linear(x.float(), q.float() * scales[:, None])) < 1e-2


def test_gguf_q4_blocks_equal_the_file_dequantized(smol_parts):
    config, _, state = smol_parts
    packed = dict(gguf_weights(default_model_path(), config, keep_packed=True))
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight"):
        p = packed[name]
        assert isinstance(p, Packed4) and p.perm is None and p.group == 32
        gidx = torch.arange(p.q.shape[1]) // 32
        deq = (p.q.float() - 8) * p.scales[gidx].T + p.zeros[gidx].T
        assert torch.allclose(deq, state[name], atol=1e-6), name  # same values, permutation undone


def q4_k_tensor(rows: int, cols: int, seed: int = 0, d: float = 3e-2):
    """A GGUF Q4_K tensor as GGUFReader gives it (raw bytes [rows, cols / 256 * 144]): random
    nibbles and 6-bit scales and mins (any bytes are valid there), finite fp16 d and dmin."""
    import types

    import numpy as np
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(d / 30, d, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(d / 30, d, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return types.SimpleNamespace(data=blocks.reshape(rows, -1), tensor_type=GGMLQuantizationType.Q4_K)


def test_gguf_q4_k_blocks_stay_packed_and_equal_the_reference_dequantizer():
    """Q4_K (what Q4_K_M files hold) kept 4-bit: its super-blocks become groups of 32 of our int4
    kernel, equal to the gguf package's dequantization of the same bytes; the kernel's product
    equals the dense one."""
    from gguf.quants import dequantize

    from engine.checkpoint.gguf import _packed_from_blocks

    t = q4_k_tensor(64, 512)
    packed = _packed_from_blocks(t, None)
    reference = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
    assert packed.group == 32 and packed.q.shape == (64, 512) and int(packed.q.max()) <= 15
    assert torch.allclose(packed.dequantize(), reference, rtol=1e-6, atol=1e-6)
    weight = Int4Weight(packed.q, packed.scales, packed.zeros, 32, torch.bfloat16, keep_dense=False)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert rel(weight.matmul(x), F.linear(x.float(), reference)) < 2e-2


def gguf_with_q4_k_ffn_down(path: str) -> None:
    """Every layer's ffn_down (1536 inputs: six super-blocks a row) as random Q4_K blocks."""
    from gguf import GGMLQuantizationType

    rewritten_gguf(path, lambda t: (q4_k_tensor(576, 1536, 0, d=2e-4).data, GGMLQuantizationType.Q4_K)
                   if t.name.endswith("ffn_down.weight") else (t.data, t.tensor_type))


def test_the_gguf_tensor_index_is_kept_and_maps_the_same_bytes(tmp_path, monkeypatch):
    """After the first read, a GGUF's tensors come from the kept index (no metadata parse), as the
    same names, types and bytes GGUFReader gives; a damaged index is read again from the file."""
    import gguf

    from engine.checkpoint import gguf as gguf_module

    monkeypatch.setenv("PAGEDCHAT_CACHE", str(tmp_path))
    path = default_model_path()
    assert gguf_module.gguf_tensors(path)[0] == "llama"
    [index] = (tmp_path / "gguf").glob("*.tensors.json")
    real_read = gguf_module._read_index
    monkeypatch.setattr(gguf_module, "_read_index", lambda p: pytest.fail("the file was parsed again"))
    arch, tensors = gguf_module.gguf_tensors(path)
    reader = gguf.GGUFReader(path)
    assert [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in tensors] == \
        [(t.name, int(t.tensor_type), t.data.dtype, t.data.shape) for t in reader.tensors]
    assert all(np.array_equal(ours.data, theirs.data) for ours, theirs in zip(tensors, reader.tensors))
    index.write_text("{")
    monkeypatch.setattr(gguf_module, "_read_index", real_read)
    assert [t.name for t in gguf_module.gguf_tensors(path)[1]] == [t.name for t in tensors]
    assert json.loads(index.read_text())["arch"] == "llama"


def test_the_fast_tensor_index_equals_gguf_readers(tmp_path):
    """The index read through transformers' header (no metadata parse) holds what GGUFReader gives
    for every storage type (values, BF16 bytes, K-quant and Q8_0 blocks, 1-D and 3-D); a type that
    header does not size (Q5_0) falls back to GGUFReader."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from engine.checkpoint import gguf as gguf_module

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, size=(4, 512)).astype(np.float32)
    tensors = {"a.f32": (w[0], T.F32), "b.f16": (w.astype(np.float16), T.F16),
               "c.i32": (np.arange(6, dtype=np.int32).reshape(2, 3), T.I32),
               "d.bf16": (quantize(w, T.BF16), T.BF16), "e.q8_0": (quantize(w, T.Q8_0), T.Q8_0),
               "f.q4_k": (np.zeros((4, 2 * 144), np.uint8), T.Q4_K),  # (the package packs no K-quants)
               "g.q6_k": (np.zeros((2, 2, 2 * 210), np.uint8), T.Q6_K)}
    for name, extra in (("typed.gguf", {}), ("q5.gguf", {"h.q5_0": (quantize(w, T.Q5_0), T.Q5_0)})):
        path = str(tmp_path / name)
        writer = gguf.GGUFWriter(path, "llama")
        for tensor, (data, kind) in {**tensors, **extra}.items():
            writer.add_tensor(tensor, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert gguf_module._read_index(path) == gguf_module._read_index_slowly(path), name


@pytest.mark.e2e
def test_a_gguf_with_q4_k_tensors_runs_them_packed(tmp_path):
    """A file holding Q4_K tensors loads them into the int4 kernel (no dense copy where int8 rows
    take every row) and computes what the same file dequantized computes."""
    path = str(tmp_path / "smollm2-q4_k.gguf")
    gguf_with_q4_k_ffn_down(path)
    packed = LLM(path, dtype="bfloat16", num_kv_blocks=32)
    dense = LLM(path, dtype="bfloat16", quantization="none", num_kv_blocks=32)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    for layer in (0, 5, 29):  # (random weights make the whole model chaotic: compare layer by layer)
        ours, theirs = (m.engine.model.model.layers[layer].mlp.down_proj for m in (packed, dense))
        assert isinstance(ours.kernel, Int4Weight) and ours.kernel.K == 1536
        assert rel(ours(x), theirs(x)) < 2e-2
    out = packed.generate([list(range(200, 230))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_tiny_model_close_to_dequantized_and_full_precision(mode, tiny_model):
    path, _ = tiny_model("llama", std=0.02)
    quantized = LLM(path, dtype="bfloat16", quantization=mode, num_kv_blocks=64)
    full = LLM(path, dtype="float32", num_kv_blocks=64)
    ids = list(range(100, 140))
    by_dense = paged_logits(quantized, ids, [40])  # 40 rows: dense copy of the dequantized weights
    by_kernel = paged_logits(quantized, ids, [36, 1, 1, 1, 1])  # one-row decodes: the packed kernel
    assert rel(by_kernel[-4:], by_dense[-4:]) < 3e-2  # tight: same weights, other kernel
    reference = paged_logits(full, ids, [40])
    cosine = F.cosine_similarity(by_dense.float(), reference, dim=-1).min().item()
    assert cosine > {"int4": 0.95, "int8": 0.999}[mode]  # loose: 4/8-bit random weights against fp32


def test_quantized_greedy_is_identical_across_batching_and_prefix_caching(tiny_model):
    path, _ = tiny_model("qwen2")
    prompts = [[200 + i] * (20 + i) + [7, 8, 9] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=128,
                 enable_prefix_caching=False).generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]]
    llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=128)
    together = llm.generate(prompts, params)
    again = llm.generate(prompts[:2], params)  # second time: prompts come from the prefix cache
    assert [o.outputs[0].token_ids for o in together[:2]] == alone
    assert [o.outputs[0].token_ids for o in again] == alone and again[0].num_cached_tokens > 0


def test_quantization_that_does_not_apply_is_refused(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="quantization 'gguf'"):
        LLM(path, dtype="bfloat16", quantization="gguf", num_kv_blocks=16)
    with pytest.raises(ValueError, match="quantization 'int4'"):  # no packed kernel takes fp16 rows here
        LLM(path, dtype="float16", quantization="int4", num_kv_blocks=16)


@pytest.mark.skipif(torch.float32 not in cpu_matmul.quant_matmul_dtypes(), reason="no AVX2 with FMA")
def test_fp32_models_keep_int4_packed_where_our_fp32_kernel_runs(tiny_model):
    """On CPUs without fast bf16 the model runs in fp32: 4-bit weights still stay 4-bit; with int8 rows
    (the default) they keep no fp32 dense copy and are never timed for AMX tiles (which read the bf16
    kernels' layout), without them they keep one for prompt rows."""
    from engine.quant.choose import shape_key

    path, _ = tiny_model("llama")
    for int8 in (True, False):
        llm = LLM(path, dtype="float32", quantization="int4", num_kv_blocks=16, int8_activations=int8)
        layer = next(m for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "kernel", None), Int4Weight))
        assert layer.kernel.kernel_dtype == torch.float32 and layer.kernel.packed.dtype == torch.uint8
        assert layer.kernel.int8_rows == int8 and (layer.kernel.dense is None) == int8
        assert shape_key(layer.kernel) is None
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4


needs_packing = pytest.mark.skipif(not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
                                   reason="no oneDNN bf16 matmul on this CPU")


@needs_packing
def test_packed_dense_weight_computes_the_plain_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    dense = DenseKernel(w)
    assert dense.packed is not None and dense.plain is None
    for rows in (0, 1, 5, 64):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.allclose(dense(x, b).float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
    x = torch.randn(2, 3, 128, generator=g).bfloat16()[..., ::2]  # strided, three dims
    assert torch.allclose(dense(x).float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


@needs_packing
def test_packed_weights_keep_greedy_outputs_and_count_their_bytes(tiny_model, monkeypatch):
    """A bf16 model's Linears (qkv bias included) and its tied LM head run packed; the tokens equal
    those of plain F.linear, and the packed copies are counted in the weight bytes."""
    path, _ = tiny_model("qwen2")
    prompts = [[200 + i] * (20 + i) + [7, 8, 9] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    packed = LLM(path, dtype="bfloat16", num_kv_blocks=128)
    model = packed.engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.kernel.packed is not None and qkv.weight is None and qkv.bias is not None
    assert model.lm_head.kernel.packed is not None and model.lm_head.tied  # the tied head: its own packed copy
    monkeypatch.setenv("PAGEDCHAT_NO_PACKING", "1")
    plain = LLM(path, dtype="bfloat16", num_kv_blocks=128)
    assert plain.engine.model.model.layers[0].self_attn.qkv_proj.kernel.reads_parameter  # not packed: its plain weight
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert packed.engine.weight_bytes >= plain.engine.weight_bytes + model.lm_head.kernel.resident_bytes


def random_blocks(kind, rows: int, cols: int, seed: int = 0):
    """A GGUF tensor of `kind` as GGUFReader gives it: random bytes (any are valid there) with
    finite fp16 scales and mins in each block's leading halves."""
    import types

    import numpy as np
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    at = size - 2 if kind == gguf.GGMLQuantizationType.Q6_K else 0  # Q6_K keeps its d last
    halves = 2 if kind in (gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q5_K) else 1
    raw[:, at:at + 2 * halves] = rng.uniform(1e-3, 2e-2, size=(len(raw), halves)).astype(np.float16).view(np.uint8)
    return types.SimpleNamespace(data=raw.reshape(rows, -1), tensor_type=kind)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_gguf_8_6_and_5_bit_blocks_stay_int8_and_equal_the_reference_dequantizer(kind):
    """Q8_0 and the 5- and 6-bit types (what Q8_0, Q6_K and Q4_K_M files hold besides Q4_K) as
    integers in groups of 32 (Q6_K: 16): equal to the gguf package's dequantization of the same bytes;
    the kernel's product (int8 groups, and the 5-bit kernel for the 5-bit types; rows rounded to int8
    per 32, as llama.cpp's Q8 activations) equals the dense one, and a row computes the same alone as
    in a batch."""
    import gguf
    from gguf.quants import dequantize

    from engine.checkpoint.gguf import _int8_groups
    from engine.quant.group_kernels import Int5Weight, Int8GroupWeight

    t = random_blocks(gguf.GGMLQuantizationType[kind], 64, 512)
    packed = _int8_groups(t, None)
    reference = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
    assert packed.q.dtype == torch.int8 and packed.scales.shape == (512 // packed.group, 64)
    assert packed.bits == (5 if kind.startswith("Q5") else 8)
    assert int(packed.q.max()) - int(packed.q.min()) < 2 ** packed.bits
    assert torch.allclose(packed.dequantize(), reference, rtol=1e-6, atol=1e-7)
    if not Int8GroupWeight.runs_here((64, 512), torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX-512 VNNI with bf16 here: these layers stay dense")
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    kernels = [Int8GroupWeight] + ([Int5Weight] if packed.bits == 5 else [])
    for kernel in kernels:
        weight = kernel(packed.q, packed.scales, packed.zeros, torch.bfloat16, packed.group)
        together = weight._packed_matmul(x)
        assert rel(together, F.linear(x.float(), reference)) < 2e-2, kernel
        assert torch.equal(weight._packed_matmul(x[3:4]), together[3:4])


def test_the_5_bit_kernel_reads_the_high_bits():
    """Integers 0..31 against the same weights with only their low 4 bits: the high bit (16) is in the
    product, in each of a quad's four positions and each of a block's 16 columns."""
    from engine.quant.group_kernels import Int5Weight, Int8GroupWeight

    if not Int8GroupWeight.runs_here((32, 64), torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX-512 VNNI with bf16 here")
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 32, (32, 64), generator=g, dtype=torch.int8)
    scales, zeros = torch.full((2, 32), 0.01), torch.zeros(2, 32)
    x = torch.randn(3, 64, generator=g).bfloat16()
    for k in range(4):  # one input at a time: its column of w times x[k]
        one = torch.zeros_like(x)
        one[:, k] = x[:, k]
        y = Int5Weight(q, scales, zeros, torch.bfloat16)._packed_matmul(one).float()
        expected = F.linear(one.float(), q.float() * 0.01)  # Packed8's convention: w = q * scale + zero
        assert rel(y, expected) < 2e-2, k


def test_an_int8_lm_head_gives_back_its_rows_in_every_layout(monkeypatch):
    """Int8Weight.rows (what serves a tied embedding's lookup) equals q * scale for the rows asked,
    from our kernels' layouts (int8 rows, bf16 rows, fp32) and torch's."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    q, scales = quantize_int8(w)
    ids = torch.tensor([0, 17, 63, 17, 40])
    expected = q[ids].float() * scales[ids][:, None]
    layouts = [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True), (torch.float32, False)]
    for dtype, int8_rows in layouts:
        weight = Int8Weight(q, scales, dtype, keep_dense=False, int8_rows=int8_rows)
        assert torch.allclose(weight.rows(ids), expected, rtol=1e-2 if weight.q.dim() == 2 else 0), (dtype, int8_rows)
    monkeypatch.setattr(cpu_matmul, "quant_kernel_dtype", lambda dtype: None)  # torch's kernel: plain [N, K]
    weight = Int8Weight(q, scales, torch.bfloat16, keep_dense=False)
    assert weight.q.dim() == 2 and torch.allclose(weight.rows(ids), expected, rtol=1e-2)


@pytest.mark.skipif(not OUR_KERNELS, reason="our kernels need AVX-512 BF16 or AVX2 with FMA")
@pytest.mark.parametrize("dtype", OUR_KERNELS)
def test_the_c_embedding_lookup_computes_the_torch_paths_bits(dtype):
    """A tied int8-row LM head's embedding lookup through csrc/embedding.c equals Int8Weight.rows rounded to the
    model's dtype, bit for bit; an id outside the table is an IndexError, as torch's indexing makes it."""
    from engine.quant.kernels import PackedEmbedding

    g = torch.Generator().manual_seed(3)
    q, scales = quantize_int8(torch.randn(96, 128, generator=g) * torch.rand(96, 1, generator=g) * 5)
    weight = Int8Weight(q, scales, dtype, keep_dense=False, int8_rows=True)
    embedding = PackedEmbedding(weight, dtype)
    assert embedding.lookup
    ids = torch.tensor([[0, 95, 17, 17], [63, 64, 1, 40]])
    got = embedding(ids)
    assert got.dtype == dtype and got.shape == (2, 4, 128)
    assert torch.equal(got.view(-1, 128), weight.rows(ids.reshape(-1)).to(dtype))
    for bad in (96, -1):
        with pytest.raises(IndexError):
            embedding(torch.tensor([3, bad]))


@pytest.mark.e2e
def test_the_default_model_keeps_its_embedding_once_in_the_int8_lm_head(monkeypatch):
    """The embedded GGUF's tied embedding is looked up from the LM head's int8 weight (no bf16 table
    beside it): the weights take less than the file, exactly the table's bytes less than with the
    table, the lookup equals the head's rows, and the mean NLL stays within 0.5% of the same model
    with its bf16 table."""
    import os

    from engine import loader
    from engine.quant.kernels import PackedEmbedding

    llm = LLM(dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.model
    assert isinstance(model.model.embed_tokens, PackedEmbedding)
    assert not any("embed_tokens" in name for name, _ in model.named_parameters())
    assert llm.engine.weight_bytes < os.path.getsize(default_model_path())
    ids = torch.tensor([[5, 900, 49151]])
    assert torch.equal(model.model.embed_tokens(ids)[0], model.lm_head.kernel.rows(ids[0]).bfloat16())
    monkeypatch.setattr(loader, "share_tied_embedding", lambda net: False)
    table = LLM(dtype="bfloat16", num_kv_blocks=64)
    embedding = table.engine.model.model.embed_tokens.weight
    assert table.engine.weight_bytes - llm.engine.weight_bytes == embedding.numel() * 2
    text = open(os.path.join(os.path.dirname(__file__), "data", "eval_passage.txt")).read()
    tokens = llm.get_tokenizer().encode(text)[:384]
    assert llm.mean_nll(tokens) < 1.005 * table.mean_nll(tokens)


@pytest.mark.e2e
def test_a_q8_0_file_of_the_default_model_runs_packed_and_holds_the_nll(tmp_path):
    """A Q8_0 file of SmolLM2 loads its projections as int8 groups (where the kernel runs), answers,
    and its mean NLL on the eval passage stays within 1.05x of the same weights dense (both in the CPU's dtype: bf16 where its kernels are, else
    fp32)."""
    import os

    from engine.quant.group_kernels import Int8GroupWeight

    path = str(tmp_path / "smollm2-q8_0.gguf")
    q8_0_gguf(path)
    packed = LLM(path, num_kv_blocks=64)
    dense = LLM(default_model_path(), quantization="none", num_kv_blocks=64)
    down = packed.engine.model.model.layers[3].mlp.down_proj.kernel
    if Int8GroupWeight.runs_here((576, 1536), packed.engine.dtype, torch.device("cpu")):
        assert isinstance(down, Int8GroupWeight)
    ids = packed.get_tokenizer().encode(open(os.path.join(os.path.dirname(__file__), "data", "eval_passage.txt")).read())
    ids = ids[:384]
    nll, base = packed.mean_nll(ids), dense.mean_nll(ids)
    assert nll < 1.05 * base, (nll, base)
    prompt = packed.render_chat([{"role": "user", "content": "Hello! How can I return a tent?"}])
    reply = packed.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert len(reply[0].outputs[0].text.split()) >= 3
    print(f"Q8_0: NLL {nll:.4f} vs dense {base:.4f}; weights {packed.engine.weight_bytes / 2**20:.0f} MiB, "
          f"file {os.path.getsize(path) / 2**20:.0f} MiB")


@pytest.mark.e2e
def test_a_q4_k_m_file_of_the_default_model_runs_packed_and_holds_the_nll(tmp_path):
    """Every block type of a Q4_K_M mix stays packed (Q4_K in the int4 kernel, Q5_0 in the 5-bit one,
    Q6_K / Q8_0 as int8 groups, where those kernels run) in at most 1.3x the file's bytes (the int8 LM
    head serves the embedding lookup too); the model answers and its mean NLL on the eval passage
    stays within 1.05x of the embedded model's weights dense (the CPU's dtype, as the Q8_0 test)."""
    import os

    from engine.quant.group_kernels import Int5Weight, Int8GroupWeight
    from engine.quant.kernels import PackedEmbedding

    path = str(tmp_path / "smollm2-q4_k_m.gguf")
    q4_k_m_gguf(path)
    mixed = LLM(path, num_kv_blocks=64)
    dense = LLM(default_model_path(), quantization="none", num_kv_blocks=64)
    layers = mixed.engine.model.model.layers
    assert isinstance(layers[4].mlp.down_proj.kernel, Int4Weight)  # Q4_K (layer 5 is one given more bits)
    if Int8GroupWeight.runs_here((576, 1536), mixed.engine.dtype, torch.device("cpu")):
        assert isinstance(layers[0].mlp.down_proj.kernel, Int8GroupWeight)  # Q6_K, groups of 16
        assert layers[0].mlp.down_proj.kernel.group_size == 16
        assert isinstance(layers[4].self_attn.qkv_proj.kernel, Int5Weight)  # Q5_0 shards, one 5-bit kernel
        assert isinstance(layers[5].self_attn.qkv_proj.kernel, Int8GroupWeight)  # Q5_0 q, k beside a Q8_0 v
        assert isinstance(mixed.engine.model.model.embed_tokens, PackedEmbedding)
        assert mixed.engine.weight_bytes <= 1.3 * os.path.getsize(path)
    ids = mixed.get_tokenizer().encode(open(os.path.join(os.path.dirname(__file__), "data", "eval_passage.txt")).read())
    nll, base = mixed.mean_nll(ids[:384]), dense.mean_nll(ids[:384])
    assert nll < 1.05 * base, (nll, base)
    prompt = mixed.render_chat([{"role": "user", "content": "Hello! How can I return a tent?"}])
    assert len(mixed.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text.split()) >= 3
    print(f"Q4_K_M mix: NLL {nll:.4f} vs dense {base:.4f}; weights {mixed.engine.weight_bytes / 2**20:.0f} MiB, "
          f"file {os.path.getsize(path) / 2**20:.0f} MiB")


def test_the_k_quant_fixtures_read_back_through_the_reference_dequantizer():
    """tests/kquants.py packs in llama.cpp's layout: the gguf package reads its blocks back within
    the rounding of 4 and 6 bits (a misplaced bit would cost ~100%)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from tests.kquants import quantize_q4_k, quantize_q6_k

    w = np.random.default_rng(0).normal(0, 0.05, size=(32, 512)).astype(np.float32)
    for quantize, kind, bound in ((quantize_q4_k, T.Q4_K, 0.1), (quantize_q6_k, T.Q6_K, 0.03)):
        back = dequantize(quantize(w), kind)
        assert np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean()) < bound, kind.name
