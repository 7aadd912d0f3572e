"""Which quantization a model loads in, and what an operator may choose from."""
from __future__ import annotations

import hashlib
import json
import os

import torch

from engine.config import EngineConfig, cache_dir

CHECKPOINT_FORMATS = ("gptq", "awq", "compressed-tensors")

PRODUCE_GPTQ = "gptq (quantize now)"  # an operator's choice: run our GPTQ producer, then load its checkpoint


def packed_kernels_take(dtype: torch.dtype) -> bool:
    """Whether quantized weights serve a model of `dtype` packed: bf16 everywhere (torch's kernels or
    ours), fp32 where our AVX2 kernel runs (engine/csrc/quant_matmul_f32.c); else they would be
    dequantized."""
    from engine.quant import cpu_matmul

    return dtype == torch.bfloat16 or dtype in cpu_matmul.quant_matmul_dtypes()


def valid_modes(source_kind: str, dtype: torch.dtype) -> list[str]:
    """Modes that apply to a model: those whose packed kernels take its activations' dtype."""
    modes = ["none"]
    if packed_kernels_take(dtype):
        modes += ["int8", "int4", "int4-g64"] + (["gguf"] if source_kind == "gguf" else [])
    return modes


def choose_mode(asked: str | None, spec, source_kind: str, dtype: torch.dtype) -> str:
    """The mode a model loads in: its checkpoint's own 4-bit format (dequantized where the packed
    kernels do not take the dtype, or when "none" is asked for), the GGUF's blocks kept packed by
    default where they do, or what was asked for, if it applies."""
    if spec is not None:
        if asked not in (None, "none", spec.method):
            raise ValueError(f"quantization {asked!r} contradicts the checkpoint, which is {spec.method}")
        packed = asked != "none" and packed_kernels_take(dtype)
        return spec.method if packed else f"{spec.method} (dequantized)"
    modes = valid_modes(source_kind, dtype)
    mode = asked if asked is not None else ("gguf" if "gguf" in modes else "none")
    if mode not in modes:
        raise ValueError(f"quantization {mode!r} does not apply to this model in {dtype}; valid: {modes}")
    return mode


def quantization_choices(source_kind: str, spec, dtype: torch.dtype) -> list[str]:
    """What an operator may pick for a model, its default first: its checkpoint's own format, or
    the modes that apply plus our GPTQ producer."""
    if spec is not None:
        return [spec.method]
    default = choose_mode(None, None, source_kind, dtype)
    return [default] + [m for m in valid_modes(source_kind, dtype) if m != default] + [PRODUCE_GPTQ]


def quantization_choices_for(model: str | None, config: EngineConfig) -> list[str]:
    """The choices for a model not loaded yet (the operator's switcher), its default first. Reads
    config.json itself: transformers may be importing on the engine thread at this moment."""
    from types import SimpleNamespace

    from engine.checkpoint.quantized import detect
    from engine.checkpoint.source import resolve_model

    try:
        src = resolve_model(model)
        spec = None
        if src.kind == "folder":
            with open(os.path.join(src.path, "config.json")) as f:
                config_json = SimpleNamespace(quantization_config=json.load(f).get("quantization_config"))
            spec = detect(src.path, config_json)
    except (ValueError, OSError):
        return ["none"]
    return quantization_choices(src.kind, spec, config.resolved_dtype(config.resolved_device()))


def resolve_switch(model: str | None, quantization: str | None) -> tuple[str | None, str | None]:
    """(model, quantization) to load for an operator's choice. PRODUCE_GPTQ runs our GPTQ producer
    once (cached under the cache folder) and loads its checkpoint; a checkpoint format lets the
    checkpoint decide."""
    if quantization == PRODUCE_GPTQ:
        folder = gptq_folder(model)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            from engine.quant.gptq import quantize_checkpoint

            try:
                quantize_checkpoint(model, folder, 64)
            except Exception as e:  # noqa: BLE001 - the operator sees why; the old model keeps serving
                raise ValueError(f"GPTQ failed: {e}") from e
        return folder, None
    return model, None if quantization in CHECKPOINT_FORMATS else quantization


def gptq_folder(model: str | None) -> str:
    """Where our GPTQ producer writes a model's 4-bit checkpoint (reused on the next switch)."""
    key = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), "gptq", key)
