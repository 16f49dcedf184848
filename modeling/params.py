"""Parameter counts of a built model, total, activated per token and per component.

Counted: parameters and persistent buffers (what a checkpoint holds: V3's router correction
bias is a buffer and is counted, the RoPE frequencies are not).
"""

from __future__ import annotations

from torch import nn

from modeling.families.deepseek.config import ModelConfig
from modeling.common.model import Transformer

__all__ = ["COMPONENTS", "count_by_component", "count_total", "count_activated"]

COMPONENTS = ("embedding", "attention", "norms", "dense_mlp", "router", "routed_experts",
              "shared_experts", "output_head", "mtp_projection", "mtp_layer")


def _component(module_name: str, module: nn.Module) -> str:
    parts = module_name.split(".")
    if parts[0] == "mtp":  # everything of an MTP module, its norms included
        return "mtp_layer" if parts[2] == "block" else "mtp_projection"
    if isinstance(module, nn.RMSNorm):  # including MLA's q_norm and kv_norm
        return "norms"
    if parts[0] == "embed":
        return "embedding"
    if parts[0] == "head":
        return "output_head"
    sub = parts[2]  # layers.{i}.<sub>...
    if sub == "attn":
        return "attention"
    if len(parts) > 3 and parts[3] == "gate":
        return "router"
    if len(parts) > 3 and parts[3] == "experts":
        return "routed_experts"
    if len(parts) > 3 and parts[3] == "shared_experts":
        return "shared_experts"
    return "dense_mlp"


def _entries(model: nn.Module, buffers: bool):
    """(component, tensor) for every parameter (and persistent buffer), shared ones once."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        if buffers:
            tensors += [(name, buf) for name, buf in module.named_buffers(recurse=False)
                        if name not in module._non_persistent_buffers_set]
        for _, tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield _component(module_name, module), tensor


def count_by_component(model: Transformer, buffers: bool = True) -> dict[str, int]:
    """Element counts per component (``COMPONENTS``; MTP modules counted apart from the main
    model; the main model's RMSNorms, MLA's q_norm and kv_norm included, under "norms"). Shared
    tensors (a
    tied head, the MTP's use of the embedding) count once."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for component, tensor in _entries(model, buffers):
        counts[component] += tensor.numel()
    return counts


def count_total(model: Transformer, include_mtp: bool = True) -> int:
    """All parameters and persistent buffers, with or without the MTP modules."""
    counts = count_by_component(model)
    return sum(v for k, v in counts.items() if include_mtp or not k.startswith("mtp"))


def count_activated(model: Transformer, cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Parameters a token computes with: the total less the input embedding table (a lookup)
    and, in every MoE layer, the routed experts it does not go to ((N_r - k) experts of
    3 * h * moe_intermediate_size each); the output head is included. This convention gives
    DeepSeek's published "activated" figures: V3 36.6B ("37B"), V2 20.9B ("21B"), V2-Lite
    2.45B ("2.4B")."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    layers = range(cfg.num_layers + (cfg.num_mtp_modules if include_mtp else 0))
    unused = sum(cfg.is_moe_layer(i) for i in layers) * (
        cfg.num_routed_experts - cfg.num_experts_per_tok) * per_expert
    embedding = 0 if cfg.tie_word_embeddings else count_by_component(model)["embedding"]
    return count_total(model, include_mtp) - unused - embedding
