"""Megatron-LM's GPT model (``GPTModel``): LayerNorm or RMSNorm, learned absolute positions or
RoPE, GELU / squared-ReLU / SwiGLU MLP, biases, tied embeddings by default."""
