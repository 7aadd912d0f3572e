"""The seams the layout promises (docs/ARCHITECTURE.md): which side imports what, where the
environment is read, the model contract, kernel paths chosen when a layer is built."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_scheduler_side_imports_no_torch():
    modules = imported_after("import engine.scheduler, engine.kv_cache_manager, engine.parallel, engine.outputs, "
                             "engine.block_pool, engine.request, engine.client")
    assert "engine.scheduler" in modules and "torch" not in modules


def test_checkpoint_reading_imports_no_quantization_code():
    modules = imported_after("import engine.checkpoint.load, engine.checkpoint.quantized")
    assert "engine.checkpoint.load" in modules
    assert not {m for m in modules if m.startswith("engine.quant")}


def test_the_environment_is_read_in_engine_config_alone():
    readers = []
    for path in [ROOT / "app.py", *ROOT.glob("engine/**/*.py"), *ROOT.glob("server/**/*.py"),
                 *ROOT.glob("ui/**/*.py"), *ROOT.glob("storage/**/*.py")]:
        text = path.read_text()
        if re.search(r"os\.environ(?!\.setdefault)|os\.getenv", text):  # engine/__init__ sets OMP_WAIT_POLICY
            readers.append(str(path.relative_to(ROOT)))
    assert readers == ["engine/config.py"], readers


def test_every_registered_model_meets_the_contract(tiny_model):
    from transformers import AutoConfig

    from engine.linear import Linear
    from engine.models import ARCHITECTURES, register_model
    from engine.models.registry import CONTRACT

    for cls in set(ARCHITECTURES.values()):
        assert all(hasattr(cls, name) for name in CONTRACT)
    path, _ = tiny_model("llama")
    model = ARCHITECTURES["LlamaForCausalLM"](AutoConfig.from_pretrained(path), 64)
    assert isinstance(model.lm_head, Linear)
    with pytest.raises(TypeError, match="compute_logits"):
        register_model("Broken")(type("Broken", (), {"packed_modules_mapping": {}, "forward": None,
                                                     "attention_layers": None}))
    assert "Broken" not in ARCHITECTURES


def test_layers_choose_their_kernel_path_when_built(monkeypatch):
    """Once built, a layer's forward never asks whether the kernels exist (no lock, no probe)."""
    from engine import cpu_kernels
    from engine.layers import RMSNorm, SiluAndMul

    norm, act = RMSNorm(64, 1e-6), SiluAndMul()
    assert norm.kernels == act.kernels == cpu_kernels.available()

    def asked():
        raise AssertionError("available() called per forward")
    monkeypatch.setattr(cpu_kernels, "available", asked)
    x = torch.randn(3, 64)
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5)
    assert act(torch.randn(3, 128)).shape == (3, 64)


def test_a_tied_lm_head_runs_the_embedding():
    from engine.linear import Linear

    embedding = torch.nn.Embedding(10, 4)
    head = Linear(4, 10, tied_to=embedding.weight)
    assert head.weight is None and not list(head.parameters())
    x = torch.randn(2, 4)
    assert torch.allclose(head(x), x @ embedding.weight.T)
