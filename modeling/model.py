"""The DeepSeek-V2 / V3 language model for one training step: embedding, decoder layers (held
in a ``ModuleDict`` keyed by the global layer number), final RMSNorm, output head, cross-entropy
loss, and V3's multi-token-prediction (MTP) modules sharing the embedding and the head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.block import Block
from modeling.config import ModelConfig
from modeling.linear import Linear
from modeling.routing import RoutingModel

__all__ = ["Transformer", "MTPModule", "MTP_LOSS_WEIGHT", "build_model"]

# DeepSeek-V3 technical report (arXiv 2412.19437), section 4.2: the MTP loss weight is 0.3 for
# the first 10T training tokens and 0.1 afterwards.
MTP_LOSS_WEIGHT = 0.3


class MTPModule(nn.Module):
    """Multi-token prediction depth ``depth`` (1-based): ``eh_proj([enorm(emb(t_{i+k}));
    hnorm(h_{i})])`` through one decoder layer and a final norm (``norm``, Hugging Face's
    ``shared_head.norm``); the embedding and output head are the main model's."""

    def __init__(self, layer_id: int, cfg: ModelConfig, attention: str, experts: str):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.block = Block(layer_id, cfg, attention, experts)
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, hidden: Tensor, embedded: Tensor, routing: RoutingModel) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.norm(self.block(x, routing))  # (b, s, h)


class Transformer(nn.Module):
    """The whole model. ``forward(tokens, labels, routing)`` returns the training loss.

    Args:
        cfg: sizes.
        attention: ``"flash"`` or ``"eager"`` (``modeling.mla.MLA``).
        experts: ``"grouped"`` or ``"sequential"`` (``modeling.moe.MoE``).

    Tokens and labels are ``(b, s)`` int64. MTP depth k predicts the token k positions further:
    its inputs are the tokens and labels rolled left by k (same length s, as Megatron-LM does).
    """

    def __init__(self, cfg: ModelConfig, attention: str = "flash", experts: str = "grouped"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(i, cfg, attention, experts)
                                     for i in range(cfg.num_layers)})
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = nn.ModuleDict({str(i): MTPModule(cfg.num_layers + i, cfg, attention, experts)
                                  for i in range(cfg.num_mtp_modules)})

    def _loss(self, hidden: Tensor, labels: Tensor) -> Tensor:
        logits = self.head(hidden)  # (b, s, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def forward(self, tokens: Tensor, labels: Tensor, routing: RoutingModel) -> Tensor:
        h = self.embed(tokens)  # (b, s, h)
        for layer in self.layers.values():
            h = layer(h, routing)
        loss = self._loss(self.norm(h), labels)
        for depth, module in enumerate(self.mtp.values(), start=1):
            h = module(h, self.embed(tokens.roll(-depth, dims=1)), routing)
            loss = loss + MTP_LOSS_WEIGHT * self._loss(h, labels.roll(-depth, dims=1))
        return loss


def build_model(cfg: ModelConfig, device: str | torch.device = "meta", *,
                attention: str = "flash", experts: str = "grouped",
                dtype: torch.dtype | None = None) -> Transformer:
    """``Transformer(cfg)`` built directly on ``device``, its parameters in ``dtype`` (default
    the config's ``torch_dtype``); buffers (the router's correction bias, RoPE frequencies)
    stay float32, as in DeepSeek-V3's reference model."""
    dtype = dtype or getattr(torch, cfg.dtype)
    with torch.device(device):
        model = Transformer(cfg, attention, experts)
    for param in model.parameters():  # in place, so a tied head stays tied
        param.data = param.data.to(dtype)
    return model
