"""A new attention variant estimated before its kernel exists (docs/modified-architectures.md).

``WindowAttention`` is grouped-query sliding-window attention (8 KV heads, each query attends to
the last ``WINDOW`` tokens) whose fused kernel ``mylab::window_attn`` is not written yet: today it
exists only as a ``torch.library`` custom op with a fake implementation (``register_fake``) that
gives its outputs' shapes, and a backward op with a fake of its own. That is all tracemem needs:
on the meta device the fakes run, and the tracer sees the op's outputs and what its autograd
saves, as it sees any aten op's.

The layer follows modeling.common.custom's calling convention: ``WindowAttention(ctx)`` with
a ``modeling.common.custom.LayerContext``, ``forward(x)`` on this rank's tokens
``(b, s / (cp * sp), h)``.
Its two weights declare their groups where they are made (``modeling.parallel.groups``): the
fused QKV projection is column-parallel (TP splits dim 0), the output projection row-parallel
(TP splits dim 1), both dense, counted under "attention".

Run it on DeepSeek-V3's ``make demo`` layout:

    tracemem estimate --model deepseek-v3 ... \\
        --replace attn=docs/examples/window_attention.py:WindowAttention
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.parallel.collectives import all_gather, reduce_scatter
from modeling.parallel.groups import column, declare, row

WINDOW = 1024  # tokens each query attends to
KV_HEADS = 8  # key / value heads (grouped-query attention)
HEAD_DIM = 128


# ----------------------------------------------------------------------- the kernel-to-be
@torch.library.custom_op("mylab::window_attn", mutates_args=())
def window_attn(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """Fused sliding-window attention. q ``(b, n, s, d)``, k / v ``(b, n_kv, s, d)``; returns
    the output ``(b, n, s, d)`` and the log-sum-exp ``(b, n, s)`` fp32 kept for backward."""
    raise NotImplementedError("mylab::window_attn has no kernel yet; it runs on meta only")


@window_attn.register_fake
def _(q, k, v, window):
    b, n, s, _ = q.shape
    return q.new_empty(b, n, s, v.shape[-1]), q.new_empty(b, n, s, dtype=torch.float32)


@torch.library.custom_op("mylab::window_attn_backward", mutates_args=())
def window_attn_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v."""
    raise NotImplementedError("mylab::window_attn_backward has no kernel yet")


@window_attn_backward.register_fake
def _(grad, q, k, v, out, lse, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # what a FlashAttention-style kernel keeps
    ctx.window = window


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = window_attn_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.window)
    return dq, dk, dv, None


window_attn.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------- the layer
class WindowAttention(nn.Module):
    """Sliding-window GQA. Heads held: ``ctx.sizes.num_heads`` query heads (n_h / TP) and
    KV_HEADS / TP key / value heads; SP gathers the sequence before the QKV projection and
    reduce-scatters after the output projection; CP gathers K and V."""

    def __init__(self, ctx):
        super().__init__()
        sizes, h = ctx.sizes, ctx.cfg.hidden_size
        self.heads, self.kv_heads = sizes.num_heads, max(1, KV_HEADS // sizes.tp)
        self.sp, self.cp = sizes.sp, sizes.cp
        qkv = (self.heads + 2 * self.kv_heads) * HEAD_DIM
        self.wqkv = declare(nn.Parameter(torch.empty(qkv, h)), column("attention"))
        self.wo = declare(nn.Parameter(torch.empty(h, self.heads * HEAD_DIM)), row("attention"))

    def forward(self, x: Tensor) -> Tensor:
        x = all_gather(x, self.sp, dim=1)  # (b, s / cp, h)
        b, s, _ = x.shape
        q, k, v = F.linear(x, self.wqkv).split(
            [self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)  # (b, n, s / cp, d)
        k = k.reshape(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.reshape(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        k, v = all_gather(k, self.cp, dim=2), all_gather(v, self.cp, dim=2)
        out, _ = window_attn(q, k, v, WINDOW)  # (b, n, s / cp, d)
        out = F.linear(out.transpose(1, 2).reshape(b, s, -1), self.wo)  # (b, s / cp, h)
        return reduce_scatter(out, self.sp, dim=1)  # (b, s / (cp * sp), h)
