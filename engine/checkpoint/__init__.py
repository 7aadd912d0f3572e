"""Checkpoints: where a model comes from (source.py), GGUF files (gguf.py), 4-bit formats
(quantized.py), and loading their tensors into our model once (load.py)."""
