"""Llama 2 / 3 / 3.1 (grouped-query attention, SwiGLU MLP, RoPE)."""
