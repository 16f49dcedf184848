"""DeepSeek-V2 / V3 (MLA attention, DeepSeekMoE with shared experts, MTP)."""
