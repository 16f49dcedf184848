"""Mixtral (grouped-query attention, 8 experts top-2 with the softmax over the chosen logits,
no shared expert)."""
