"""AMX tiles for the int8-row kernels (csrc/quant_amx.h) and the choice between them and the VNNI tiles
by measurement at load (engine/quant/choose.py)."""
import json
import os

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.linear import Linear
from engine.quant import choose, cpu_matmul
from engine.quant.group_kernels import Int5Weight, Int8GroupWeight
from engine.quant.kernels import Int4Weight, Int8Weight, quantize_int4, quantize_int8

amx = pytest.mark.skipif(not cpu_kernels.has("amx_tiles"), reason="no AMX-INT8 here, or Linux does not lend it")


def kernels_of_every_kind(N: int = 96, K: int = 384) -> dict[str, object]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N, K, generator=g)
    q8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q5 = torch.randint(0, 32, (N, K), generator=g, dtype=torch.int8)
    scales, zeros = torch.rand(K // 32, N, generator=g) * 0.02 + 1e-3, torch.randn(K // 32, N, generator=g) * 0.01
    kinds = {f"int4 g{group}": Int4Weight(*quantize_int4(w, group), group, torch.bfloat16, keep_dense=False)
             for group in (32, 128)}
    kinds["int8 per channel"] = Int8Weight(*quantize_int8(w), torch.bfloat16, keep_dense=False)
    kinds["int8 groups of 32"] = Int8GroupWeight(q8, scales, zeros, torch.bfloat16)
    kinds["5-bit"] = Int5Weight(q5, scales, zeros, torch.bfloat16)
    return kinds


@amx
@pytest.mark.parametrize("kind", ["int4 g32", "int4 g128", "int8 per channel", "int8 groups of 32", "5-bit"])
def test_amx_tiles_compute_the_same_bits_as_the_vnni_tiles(kind):
    """Every row count around the 16-row tiles and the 256-row passes, with large and zero rows: the AMX
    tiles' results equal the VNNI tiles' bit for bit (what lets the choice be made for speed alone)."""
    kernel = kernels_of_every_kind()[kind]
    g = torch.Generator().manual_seed(12)
    for rows in (16, 17, 31, 48, 64, 271):
        x = (torch.randn(rows, kernel.K, generator=g) * torch.rand(rows, 1, generator=g) * 50).bfloat16()
        x[rows // 2] = 0
        kernel.amx_from = 0
        vnni = kernel._packed_matmul(x)
        kernel.amx_from = 16
        before = cpu_matmul.amx_tiles_computed()
        tiles = kernel._packed_matmul(x)
        assert torch.equal(tiles.view(torch.int16), vnni.view(torch.int16)), (kind, rows)
        # whole tiles of 16 rows in each pass of 256 rows, for every block of 16 columns
        assert cpu_matmul.amx_tiles_computed() - before == kernel.N // 16 * (rows // 256 * 16 + rows % 256 // 16)


def test_the_rule_takes_the_fewest_rows_from_which_amx_wins_at_every_larger_count(monkeypatch):
    """measure(): AMX must win at that row count and every larger one; a win below a loss does not count."""
    kernel = kernels_of_every_kind()["int4 g32"]
    for amx_wins, expected in (({16, 32, 64, 128, 256}, 16), ({16, 64, 128, 256}, 64), ({16, 32, 64, 128}, 0),
                               (set(), 0)):
        def seconds(run, x, calls, wins=amx_wins):
            run(x)  # sets the kernel's amx_from for its way
            return 1.0 if (kernel.amx_from > 0) == (x.shape[0] in wins) else 2.0
        monkeypatch.setattr(choose, "_seconds", seconds)
        assert choose.measure(kernel) == expected
        assert kernel.amx_from == 0  # left as it was found
    for tiles_win, expected in (({64, 128, 256}, 64), ({16, 128}, 0)):  # bf16 tiles against the int8 rows
        monkeypatch.setattr(choose, "_seconds", lambda run, x, calls, wins=tiles_win:
                            1.0 if (run == kernel._tiles_matmul) == (x.shape[0] in wins) else 2.0)
        assert choose.measure_bf16_tiles(kernel) == expected


@amx
def test_the_choice_is_measured_once_then_read_from_the_cache(tiny_model, monkeypatch, tmp_path):
    """The first load measures each distinct layer shape and writes the answers; the next load of the same
    shapes reads them (no measuring) and gives every int8-row layer its row count; the panel says so."""
    monkeypatch.setenv("PAGEDCHAT_CACHE", str(tmp_path))
    measured = []
    real = choose.measure
    monkeypatch.setattr(choose, "measure", lambda k: measured.append(choose.shape_key(k)) or real(k))
    path, _ = tiny_model("qwen2")
    first = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16)
    kernels = [m.kernel for m in first.engine.model.modules() if isinstance(m, Linear)]
    keys = {choose.shape_key(k) for k in kernels} - {None}
    assert sorted(measured) == sorted(keys)  # once per shape, not per layer
    files = [f for f in os.listdir(os.path.join(tmp_path, "kernels")) if f.startswith("amx-")]
    assert len(files) == 1
    with open(os.path.join(tmp_path, "kernels", files[0])) as f:
        cached = json.load(f)
    assert set(cached) == keys
    measured.clear()
    second = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16)
    assert measured == []
    for m in second.engine.model.modules():
        if isinstance(m, Linear) and choose.shape_key(m.kernel) is not None:
            assert m.kernel.amx_from == cached[choose.shape_key(m.kernel)]
    from engine.snapshot import take_snapshot
    from ui.panel import memory_html

    assert ("AMX tiles" in memory_html(take_snapshot(second.engine))) == any(cached.values())  # the panel says so


@pytest.mark.skipif(not cpu_kernels.has("amx_bf16_tiles"), reason="no AMX-BF16 here, or Linux does not lend it")
def test_batch_invariant_off_gives_large_steps_to_bf16_tiles_and_on_keeps_every_row_on_int8_rows(
        tiny_model, monkeypatch, tmp_path):
    """The default (batch_invariant) never takes bf16 tiles; off, each 4-bit layer takes them from the row
    count measured faster (forced to 64 here), so a 100-row prompt step does and its one-row decodes do not."""
    monkeypatch.setenv("PAGEDCHAT_CACHE", str(tmp_path))
    monkeypatch.setattr(choose, "measure_bf16_tiles", lambda kernel: 64)
    calls = []
    tiles = Int4Weight._tiles_matmul
    monkeypatch.setattr(Int4Weight, "_tiles_matmul", lambda self, x: calls.append(x.shape[0]) or tiles(self, x))
    path, _ = tiny_model("qwen2")
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    replies = {}
    for invariant in (True, False):
        llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=32, batch_invariant=invariant)
        body = llm.engine.model.model  # the layers (the LM head computes the one row it samples)
        kernels = [m.kernel for m in body.modules() if isinstance(getattr(m, "kernel", None), Int4Weight)]
        assert kernels and {k.tiles_from for k in kernels} == ({0} if invariant else {64})
        calls.clear()
        replies[invariant] = llm.generate([list(range(100, 200))], SamplingParams(**params))[0].outputs[0].token_ids
        assert calls == ([] if invariant else [100] * len(kernels))  # the prompt step only, once per layer
    assert len(replies[False]) == 6
