"""A Linear layer and the one matmul object it runs: its kernel.

Every Linear, the LM head included, holds one LinearKernel, chosen once after loading (vLLM's
`LinearMethodBase` + `process_weights_after_loading`): a DenseKernel here, or a quantized weight
(engine/quant/kernels.py). Until then it runs its plain weight; the LM head tied to the embedding
runs the embedding's (nano-vllm's tied head).

Dense packing: on a CPU with bf16 matrix units (AMX, AVX-512 BF16), F.linear hands oneDNN a plain
row-major weight that it reorders into its tile layout on every call. For a small model's matrices
that reorder is a large share of the call: measured here, packing once made a 576x3072 matmul
10-30% faster at 1-64 rows and the 49152-row LM head up to 2x faster at one row; a batch-64 decode
step of the default model went from 163 to 135 ms. Elsewhere (CUDA, fp32, no oneDNN bf16) the
weight stays plain.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import knobs


class LinearKernel:
    """y = x W^T (+ b) for one weight W [N, K], in whatever layout the kernel keeps it."""
    label = "dense"
    reads_parameter = False  # it runs the Linear's own Parameter (its bytes count as a parameter's)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def resident_bytes(self) -> int:
        """Bytes this kernel keeps beyond the model's parameters."""
        raise NotImplementedError


def can_pack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2
            and not knobs().no_packing and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseKernel(LinearKernel):
    """A dense weight: oneDNN-packed where that pays (`pack` and can_pack), else plain F.linear."""

    def __init__(self, w: torch.Tensor, pack: bool = True) -> None:
        self.shape = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 64) \
            if pack and can_pack(w) else None
        self.plain = None if self.packed is not None else w
        self.reads_parameter = isinstance(self.plain, nn.Parameter)
        self.label = "bf16 dense, packed" if self.packed is not None else "dense"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.plain is not None:
            return F.linear(x, self.plain, bias)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.shape[0]).to(x.dtype)

    @property
    def resident_bytes(self) -> int:
        w = self.packed if self.packed is not None else self.plain
        return w.numel() * w.element_size()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b) through `self.kernel`. `shard_sizes` names the slices of a fused output (qkv,
    gate/up) so a checkpoint's separate matrices load into their place through `weight_loader`.
    `tied_to`: the layer runs that Parameter (the embedding, for a tied LM head) and owns none."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard_sizes: dict[str | int, int] | None = None, tied_to: nn.Parameter | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tied = tied_to is not None
        self.weight = None if self.tied else nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.kernel: LinearKernel = DenseKernel(tied_to if self.tied else self.weight, pack=False)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in (shard_sizes or {}).items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader

    @property
    def source_weight(self) -> torch.Tensor:
        """The dense weight as loaded (the embedding's when tied): what kernels are made from."""
        return self.kernel.plain if self.tied else self.weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        start, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, start, size), loaded)

    def set_kernel(self, kernel: LinearKernel) -> None:
        """Run `kernel` from now on; the plain weight goes unless the kernel still reads it."""
        self.kernel = kernel
        if not kernel.reads_parameter:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the weights take: parameters plus what kernels keep beside them (packed copies,
    quantized weights and their dense copies)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    kernels = {id(m.kernel): m.kernel for m in model.modules() if isinstance(m, Linear)}
    return total + sum(k.resident_bytes for k in kernels.values() if not k.reads_parameter)
