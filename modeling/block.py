"""A decoder layer: ``x + attn(attn_norm(x))``, then ``+ ffn(ffn_norm(x))`` where the FFN is
a dense SwiGLU MLP for the first ``first_k_dense_replace`` layers and an MoE after
(DeepSeek-V3 ``Block``)."""

from __future__ import annotations

from torch import Tensor, nn

from modeling.config import ModelConfig
from modeling.mla import MLA
from modeling.mlp import MLP
from modeling.moe import MoE
from modeling.parallel.plans import LocalSizes
from modeling.routing import RoutingModel

__all__ = ["Block"]


class Block(nn.Module):
    """Decoder layer ``layer_id`` (0-based, global: it decides dense vs MoE and the routing
    model's per-layer counts), with the local ``sizes`` of one rank (default unsharded).
    Input and output ``(b, s, h)``."""

    def __init__(self, layer_id: int, cfg: ModelConfig, attention: str = "flash",
                 experts: str = "grouped", sizes: LocalSizes | None = None):
        super().__init__()
        sizes = sizes or LocalSizes.full(cfg)
        self.layer_id = layer_id
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = MLA(cfg, attention, sizes.num_heads, sizes.replicate_q_rope, sizes.sp,
                        sizes.cp)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_id):
            self.ffn = MoE(cfg, experts, sizes.expert_ids, layer_id, sizes.expert_inter,
                           sizes.shared_inter, sizes.ep, sizes.etp,
                           shared_sp=sizes.sp if sizes.shared_split else 1)
        else:
            self.ffn = MLP(cfg.hidden_size, sizes.dense_inter, sizes.sp)

    def forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + (self.ffn(h, routing) if isinstance(self.ffn, MoE) else self.ffn(h))
