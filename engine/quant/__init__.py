"""Weight-only quantization: on-the-fly int8 / int4 for full-precision checkpoints, and GGUF's
4-bit and 8-bit tensors kept packed. Layers keep the product's own Linear; quantization swaps what
its matmul reads (see `kernels.py`)."""
from engine.quant.kernels import Int4Weight, Int8Weight, QuantizedWeight
from engine.quant.methods import QUANTIZATION_MODES, quantize_model, valid_modes

__all__ = ["Int4Weight", "Int8Weight", "QuantizedWeight", "QUANTIZATION_MODES", "quantize_model", "valid_modes"]
