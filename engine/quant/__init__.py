"""Weight-only quantization: on-the-fly int8 / int4 for full-precision checkpoints, and 4-bit
checkpoints (GGUF Q4 blocks, GPTQ, AWQ, compressed-tensors) kept packed. Layers keep the product's
own Linear; quantization swaps what its matmul reads (see `kernels.py`)."""

