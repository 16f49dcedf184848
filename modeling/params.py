"""Parameter counts of a built model, total, activated per token and per component.

Counted: parameters and persistent buffers (what a checkpoint holds: V3's router correction
bias is a buffer and is counted, the RoPE frequencies are not).
"""

from __future__ import annotations

from modeling.config import ModelConfig
from modeling.model import Transformer

__all__ = ["COMPONENTS", "count_by_component", "count_total", "count_activated"]

COMPONENTS = ("embedding", "attention", "norms", "dense_mlp", "router", "routed_experts",
              "shared_experts", "output_head", "mtp_projection", "mtp_layer")


def _component(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "embed":
        return "embedding"
    if parts[0] == "head":
        return "output_head"
    if parts[0] == "norm":
        return "norms"
    if parts[0] == "mtp":
        return "mtp_layer" if parts[2] == "block" else "mtp_projection"
    sub = parts[2]  # layers.{i}.<sub>...
    if sub == "attn":
        return "attention"
    if sub in ("attn_norm", "ffn_norm"):
        return "norms"
    if parts[3] == "gate":
        return "router"
    if parts[3] == "experts":
        return "routed_experts"
    if parts[3] == "shared_experts":
        return "shared_experts"
    return "dense_mlp"


def _entries(model: Transformer):
    yield from model.named_parameters()
    persistent = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf


def count_by_component(model: Transformer) -> dict[str, int]:
    """Element counts per component (``COMPONENTS``; MTP modules counted apart from the main
    model). Shared tensors (a tied head, the MTP's use of the embedding) count once."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, tensor in _entries(model):
        counts[_component(name)] += tensor.numel()
    return counts


def count_total(model: Transformer, include_mtp: bool = True) -> int:
    """All parameters and persistent buffers, with or without the MTP modules."""
    counts = count_by_component(model)
    return sum(v for k, v in counts.items() if include_mtp or not k.startswith("mtp"))


def count_activated(model: Transformer, cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Parameters a token uses: the total less, in every MoE layer, the routed experts it does
    not go to ((N_r - k) experts of 3 * h * moe_intermediate_size each). The embedding and the
    head are included (the convention behind DeepSeek-V3's "37B activated")."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    layers = range(cfg.num_layers + (cfg.num_mtp_modules if include_mtp else 0))
    unused = sum(cfg.is_moe_layer(i) for i in layers) * (
        cfg.num_routed_experts - cfg.num_experts_per_tok) * per_expert
    return count_total(model, include_mtp) - unused
