"""Parameter counts of a built model, total, activated per token and per component.

Counted: parameters and persistent buffers (what a checkpoint holds: V3's router correction
bias is a buffer and is counted, the RoPE frequencies are not). The component of each is its
declaration (``modeling.parallel.groups.ParamGroup.component``, made where the module makes
the parameter), never its name.
"""

from __future__ import annotations

from modeling.common.config import ModelConfig
from modeling.common.model import Transformer
from modeling.parallel.groups import declared_tensors

__all__ = ["COMPONENTS", "count_by_component", "count_total", "count_activated"]

COMPONENTS = ("embedding", "attention", "norms", "dense_mlp", "router", "routed_experts",
              "shared_experts", "output_head", "mtp_projection", "mtp_layer")


def count_by_component(model: Transformer, buffers: bool = True) -> dict[str, int]:
    """Element counts per component (``COMPONENTS``; MTP modules counted apart from the main
    model; the main model's norms, MLA's q_norm and kv_norm included, under "norms"; the word
    and learned position embeddings under "embedding"). Shared tensors (a tied head, the MTP's
    use of the embedding) count once. Each tensor counts under the component it declares
    (``modeling.parallel.groups``); one outside ``COMPONENTS`` (a user's layer may declare one)
    is added after them.

    Raises:
        TracememError: a parameter that declares no group (``modeling.parallel.groups``).
    """
    counts = dict.fromkeys(COMPONENTS, 0)
    for _, _, tensor, group in declared_tensors(model, buffers):
        counts[group.component] = counts.get(group.component, 0) + tensor.numel()
    return counts


def count_total(model: Transformer, include_mtp: bool = True) -> int:
    """All parameters and persistent buffers, with or without the MTP modules."""
    counts = count_by_component(model)
    return sum(v for k, v in counts.items() if include_mtp or not k.startswith("mtp"))


def count_activated(model: Transformer, cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Parameters a token computes with: the total less the input embedding tables (lookups:
    the word embedding unless it is tied to the head, the learned position embedding always)
    and, in every MoE layer, the routed experts it does not go to ((N_r - k) experts of
    3 * h * moe_intermediate_size each); the output head is included. This convention gives
    DeepSeek's published "activated" figures: V3 36.6B ("37B"), V2 20.9B ("21B"), V2-Lite
    2.45B ("2.4B"). The routed experts are the parameters declared EP-sharded
    (``modeling.parallel.groups.ParamGroup.ep``), so a user's layer without them (``replace``)
    subtracts none."""
    routed = sum(tensor.numel() for _, _, tensor, group in declared_tensors(model)
                 if group.ep and (include_mtp or group.component != "mtp_layer"))
    experts = cfg.num_routed_experts
    unused = routed * (experts - cfg.num_experts_per_tok) // experts if experts else 0
    embedding = count_by_component(model)["embedding"]  # word (and position) tables held
    if cfg.tie_word_embeddings and model.embed is not None:
        embedding -= model.embed.weight.numel()  # also the head: computed with
    return count_total(model, include_mtp) - unused - embedding
