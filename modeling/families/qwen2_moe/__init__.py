"""Qwen2-MoE / Qwen1.5-MoE (attention with q, k, v biases, softmax router, one shared expert
of its own width behind a sigmoid gate)."""
