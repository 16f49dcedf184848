"""The built-in toy that ``tracemem toy`` traces (``tracemem demo`` before: renamed because
``make demo`` runs ``tracemem estimate`` on DeepSeek-V3): a small decoder-only transformer (eager
attention) trained one step with Adam on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tracemem.errors import TracememError, divisors_hint
from tracemem.torch_state import preserved_torch_state
from tracemem.tracer import MemoryTracer
from tracemem.validation.cases import EagerAttentionBlock

__all__ = ["ToyConfig", "ToyTransformer", "trace_toy", "MAX_TOY_LAYERS"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The toy traces every layer (no signature reuse): 256 layers take about 16 s on one CPU core
# (measured, torch 2.13 CPU build); deeper models are tracemem estimate's.
MAX_TOY_LAYERS = 256


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
        from modeling.common.config import MAX_SIZE
        from tracemem.job import MAX_TOKENS, check_tensor_bytes

        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "vocab_size"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TracememError(f"{flag} {value!r:.60} must be a positive integer")
            if name == "num_layers" and value > MAX_TOY_LAYERS:
                raise TracememError(f"--num-layers {value} is more than {MAX_TOY_LAYERS}: the "
                                    f"toy traces every layer op by op (about 0.06 s each); "
                                    f"for a deep model use tracemem estimate")
            # the model config's bound (modeling.common.config): each size a tensor dimension
            if name not in ("seq_length", "micro_batch_size") and value > MAX_SIZE:
                raise TracememError(f"{flag} {value} is more than {MAX_SIZE:,}; no model is "
                                    f"near that")
        b, s, h = self.micro_batch_size, self.seq_length, self.hidden_size
        if b * s > MAX_TOKENS:
            raise TracememError(f"--micro-batch-size {b} x --seq-length {s} = {b * s:,} tokens "
                                f"per microbatch is more than 2^32; no machine holds one "
                                f"layer's activations for that")
        # the largest tensors of the step, in fp32 (the loss upcasts the logits): the eager
        # attention's b x heads x s x s scores, the b x s x vocab logits, the 4h MLP rows
        check_tensor_bytes(f"the attention scores, b {b} x {self.num_attention_heads} heads x "
                           f"s {s} x s {s} x 4 B", b * self.num_attention_heads * s * s * 4)
        check_tensor_bytes(f"the logits, b {b} x s {s} x vocab {self.vocab_size} x 4 B",
                           b * s * self.vocab_size * 4)
        check_tensor_bytes(f"the MLP rows, b {b} x s {s} x 4h {4 * h} x 4 B", b * s * 4 * h * 4)
        check_tensor_bytes(f"the embedding, vocab {self.vocab_size} x h {h} x 4 B",
                           self.vocab_size * h * 4)
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
    the meta device and return the tracer; ``rounding``: bytes each storage is rounded up to
    (at most 2^30), or None for exact bytes. Torch's global state (grad mode, default device,
    modes, hooks) is as before afterwards, however the call ends
    (``tracemem.torch_state.preserved_torch_state``: an interrupt while the model builds)."""
    from tracemem.job import MAX_ROUNDING

    if rounding is not None and (isinstance(rounding, bool) or not isinstance(rounding, int)
                                 or not 0 <= rounding <= MAX_ROUNDING):
        raise TracememError(f"--rounding {rounding!r:.40} must be a number of bytes from 0 to "
                            f"2^30 (1 GiB); the CUDA caching allocator rounds to 512 B")
    with preserved_torch_state():
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
