"""Qwen2 / Qwen2.5 (GQA with q, k, v biases) and Qwen3 (GQA with qk-norm), dense."""
