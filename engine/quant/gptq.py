"""Our GPTQ: quantize a full-precision model to 4-bit with second-order error compensation and write
the standard GPTQ checkpoint layout that other tools read.

    python -m engine.quant.gptq --model M --out DIR [--group-size 64] [--desc-act] [--sym] [--calib FILE]

Calibration: one forward pass of transformers' reference model over the calibration text collects
H = X^T X for the input of every Linear; each weight is then quantized column by column, pushing
each column's rounding error onto the columns not yet quantized through the inverse Hessian.
Asymmetric weights are written as "gptq_v2" (true zeros); --sym writes classic "gptq" (v1).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time

import torch

log = logging.getLogger("pagedchat.gptq")
CALIBRATION_TEXT = os.path.join(os.path.dirname(__file__), "calibration.txt")
# Each Linear quantized, by the input it reads: q/k/v read the same input, and so do gate/up, so each
# such group shares one Hessian and one column loop (GPTQ quantizes each row on its own).
INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
          "up_proj": "gate_up", "down_proj": "down"}


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, v1: bool) -> dict:
    """q [N, K] 0..15, scales/zeros [G, N] (zeros as integers 0..15) -> GPTQ tensors."""
    stored = (zeros.round().to(torch.int64) - (1 if v1 else 0)) & 0xF
    qt = q.T.reshape(q.shape[1] // 8, 8, q.shape[0]).transpose(1, 2)  # [K/8, N, 8]: rows 8r..8r+7
    return {"qweight": _to_int32(_sum_nibbles(qt)),
            "qzeros": _to_int32(_sum_nibbles(stored.reshape(stored.shape[0], -1, 8))),
            "scales": scales.to(torch.float16), "g_idx": g_idx.to(torch.int32)}


def _sum_nibbles(x: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> [...] words, element j in bits [4j, 4j + 4)."""
    return (x.to(torch.int64) << torch.arange(0, 32, 4)).sum(-1)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, group_size: int, sym: bool, desc_act: bool,
                  damp: float = 0.01, block: int = 128):
    """-> q [N, K] (checkpoint input order), scales [G, N], integer zeros [G, N], g_idx [K].

    The columns are walked as rows of W transposed (each a contiguous [N] vector) and updated in
    place: 1.5-2x faster than on W's strided columns, the same values bit for bit."""
    W = W.float().clone()
    H = H.float().clone()
    N, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if desc_act else torch.arange(K)
    Wt, H = W[:, perm].T.contiguous(), H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    diag = torch.diag(Hinv).tolist()
    G = K // group_size
    Q = torch.zeros(K, N)
    scales, zeros = torch.zeros(G, N), torch.zeros(G, N)
    q, err = torch.empty(N), torch.empty(N)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, Err = Wt[i1:i2].clone(), torch.zeros(i2 - i1, N)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                g = col // group_size
                span = torch.cat([W1[i:], Wt[i2:]])[:group_size]
                scales[g], zeros[g] = _group_params(span.T, sym)
                scale, zero = scales[g], zeros[g]
            w = W1[i]
            torch.div(w, scale, out=q).round_().add_(zero).clamp_(0, 15)
            Q[col] = q
            torch.sub(q, zero, out=err).mul_(scale)
            torch.sub(w, err, out=err).div_(diag[col])
            W1[i:].sub_(torch.outer(Hinv[col, col:i2], err))
            Err[i] = err
        Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err
    q = torch.empty(N, K, dtype=torch.int64)
    q[:, perm] = Q.T.to(torch.int64)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[perm] = torch.arange(K) // group_size
    return q, scales, zeros, g_idx


@contextlib.contextmanager
def flushed_denormals():
    """Subnormal floats as zeros on this thread while GPTQ runs: pushing rounding errors onto later
    columns drives many values subnormal, where x86 arithmetic is far slower (measured on SmolLM2's
    210 linears: 53 -> 22.5 s, the checkpoint bit-identical). Torch has no getter for the setting; it
    is off by default and left off after."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _group_params(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if sym:
        scale = (w.abs().amax(dim=1) * 2 / 15).clamp(min=1e-8)
        return scale, torch.full_like(scale, 8.0)
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    return scale, torch.round(-lo / scale).clamp(0, 15)


def collect_hessians(model, tokenizer, text: str, seq_len: int = 256,
                     max_chunks: int = 32) -> dict[tuple[str, ...], torch.Tensor]:
    """H = X^T X of the input of every Linear GPTQ quantizes, once per input (INPUTS), keyed by the
    names of the Linears that read it."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids) - 16, seq_len)][:max_chunks]
    groups: dict[tuple[str, str], list[tuple[str, torch.nn.Module]]] = {}  # (parent, input) -> its readers
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if leaf in INPUTS:
            groups.setdefault((parent, INPUTS[leaf]), []).append((name, module))
    hessians: dict[tuple[str, ...], torch.Tensor] = {}
    hooks = []
    for readers in groups.values():  # the first reader's hook collects the group's H
        def hook(_, inputs, __, names=tuple(name for name, _ in readers)):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            hessians[names] = hessians.get(names, 0) + x.T @ x
        hooks.append(readers[0][1].register_forward_hook(hook))
    with torch.no_grad():
        for chunk in chunks:
            model(chunk.unsqueeze(0))
    for h in hooks:
        h.remove()
    return hessians


def quantize_checkpoint(model_path: str | None, out: str, group_size: int = 64, desc_act: bool = False,
                        sym: bool = False, calib: str = CALIBRATION_TEXT) -> dict:
    """Write a GPTQ checkpoint (safetensors + config.json + tokenizer) of a model pagedchat loads."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.checkpoint.load import iter_weights
    from engine.checkpoint.source import load_config_and_tokenizer, resolve_model

    src = resolve_model(model_path)
    config, tokenizer = load_config_and_tokenizer(src)
    state = dict(iter_weights(src, config))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.eval()
    with open(calib) as f:
        hessians = collect_hessians(model, tokenizer, f.read())
    tensors = {k: v.contiguous() for k, v in state.items()}
    t0 = time.perf_counter()
    for names, H in hessians.items():  # the Linears that read one input, stacked: one column loop
        weights = [tensors.pop(f"{name}.weight") for name in names]
        with flushed_denormals():
            q, scales, zeros, g_idx = gptq_quantize(torch.cat(weights), H, group_size, sym, desc_act)
        sizes = [w.shape[0] for w in weights]
        for name, *own in zip(names, q.split(sizes), scales.split(sizes, dim=1), zeros.split(sizes, dim=1)):
            for part, value in pack_gptq(*own, g_idx, v1=sym).items():
                tensors[f"{name}.{part}"] = value.contiguous()
    log.info("quantized %d linears in %.1fs", sum(map(len, hessians)), time.perf_counter() - t0)
    os.makedirs(out, exist_ok=True)
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": "gptq" if sym else "gptq_v2", "lm_head": False, "damp_percent": 0.01}
    config.quantization_config = qc
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return qc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="GPTQ 4-bit quantization (writes the standard GPTQ layout)")
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--out", required=True)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--desc-act", action="store_true", help="act-order: quantize high-activation columns first")
    p.add_argument("--sym", action="store_true", help="symmetric (zero = 8), written as classic 'gptq' v1")
    p.add_argument("--calib", default=CALIBRATION_TEXT)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    qc = quantize_checkpoint(args.model, args.out, args.group_size, args.desc_act, args.sym, args.calib)
    print(json.dumps(qc))


if __name__ == "__main__":
    main()
