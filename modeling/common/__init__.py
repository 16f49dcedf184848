"""Building blocks shared by the model families: attention, MLP, MoE (router, experts),
routing models, norms, linears, the decoder layer and the language model around it."""
