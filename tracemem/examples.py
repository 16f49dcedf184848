"""The built-in toy that ``tracemem toy`` traces (``tracemem demo`` before: renamed because
``make demo`` runs ``tracemem estimate`` on DeepSeek-V3): a small decoder-only transformer (eager
attention) trained one step with Adam on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tracemem.errors import TracememError, divisors_hint
from tracemem.tracer import MemoryTracer
from tracemem.validation.cases import EagerAttentionBlock

__all__ = ["ToyConfig", "ToyTransformer", "trace_toy"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """Sizes of the toy model and step."""

    num_layers: int = 4  # decoder blocks
    hidden_size: int = 1024  # model width h
    num_attention_heads: int = 16  # heads; must divide hidden_size
    seq_length: int = 1024  # tokens per sequence s
    micro_batch_size: int = 1  # sequences per step b
    vocab_size: int = 32000  # output head width
    dtype: str = "bfloat16"  # parameter and activation dtype, one of DTYPES

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise TracememError(f"{flag} {value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise TracememError(
                f"--num-attention-heads {self.num_attention_heads} must divide --hidden-size "
                f"{self.hidden_size}; try {divisors_hint(self.hidden_size)}")
        if self.dtype not in DTYPES:
            raise TracememError(f"--dtype {self.dtype!r} is invalid; choose one of "
                                f"{', '.join(DTYPES)}")


class ToyTransformer(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks, final norm, vocabulary head."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({
            str(i): EagerAttentionBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length)
            for i in range(cfg.num_layers)})
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (b, s, h)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))  # (b, s, vocab)


def trace_toy(cfg: ToyConfig, rounding: int | None = None) -> MemoryTracer:
    """Trace one training step (forward, cross-entropy, backward, Adam) of the toy model on
    the meta device and return the tracer."""
    with torch.device("meta"):
        model = ToyTransformer(cfg).to(DTYPES[cfg.dtype])
        tokens = torch.zeros(cfg.micro_batch_size, cfg.seq_length, dtype=torch.long)
        labels = torch.zeros(cfg.micro_batch_size * cfg.seq_length, dtype=torch.long)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tracer = MemoryTracer(rounding=rounding, devices={"meta"})
    tracer.track_external(model, optimizer, tokens, labels)
    with tracer:
        logits = model(tokens)
        F.cross_entropy(logits.view(-1, cfg.vocab_size).float(), labels).backward()
        optimizer.step()
    return tracer
