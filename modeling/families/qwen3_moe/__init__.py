"""Qwen3-MoE (grouped-query attention with qk-norm, softmax router over all experts with the
top-k renormalised, no shared expert)."""
