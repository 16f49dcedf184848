"""Small training steps that the tracer must get right, each built identically on CPU (to run
for real under the profiler) and on the meta device (to trace).

Each case covers one thing a tracer can get wrong: views sharing a storage, in-place ops,
tensors saved for backward, recompute, custom autograd Functions, optimizer states, gradient
accumulation, buffers updated under ``no_grad``, out= resizing, MoE dispatch by index, a saved
output whose backward Node never runs, ``retain_graph``, tensor and module hooks, a training loop
with ``zero_grad``. Every case is run as a loop of several steps (``compare.STEPS``), so a
storage that outlives its step in one run and not the other shows.
``Case.unseen_bytes`` is what the real peak holds that the tracer cannot see (allocations below
the dispatcher), derived by hand; ``Case.unseen_cause`` names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Case", "Setup", "CASES", "get_case"]


@dataclass(frozen=True)
class Setup:
    """A built case: ``step()`` runs one training step; ``externals`` is what is alive before
    it (pass to ``MemoryTracer.track_external``)."""

    step: Callable[[], None]
    externals: tuple


@dataclass(frozen=True)
class Case:
    """A validation case.

    Attributes:
        name: short identifier (used as the pytest id and in benchmark tables).
        build: ``build(device) -> Setup``, deterministic for a given device.
        description: what the case exercises.
        unseen_bytes: bytes in the real CPU peak that are allocated below the dispatcher and so
            invisible to the tracer (0 when the tracer must match to the byte).
        unseen_cause: the allocations behind ``unseen_bytes``.
        unseen_bytes_later, unseen_cause_later: the same for the second and later steps of
            a loop, whose peak can fall elsewhere (gradients and optimizer states then exist
            already); ``None`` = as for the first step.
    """

    name: str
    build: Callable[[str], Setup]
    description: str
    unseen_bytes: int = 0
    unseen_cause: str = ""
    unseen_bytes_later: int | None = None
    unseen_cause_later: str = ""

    def unseen_bytes_at(self, step: int) -> int:
        """``unseen_bytes`` for step 0 of a loop, ``unseen_bytes_later`` (if set) after."""
        if step == 0 or self.unseen_bytes_later is None:
            return self.unseen_bytes
        return self.unseen_bytes_later


_WRAPPED_SCALAR = ("a Python scalar passed as a tensor argument is wrapped in a CPU float64 or int64 tensor "
                   "(8 B), and TensorIterator copies it to float32 (4 B), both below the dispatcher")


def _sgd(model: nn.Module, momentum: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                loss_fn: Callable[[], Tensor]) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        optimizer.step()
    return step


# --------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class ConvNet(nn.Module):
    """Two conv + batch-norm + in-place ReLU stages and an MLP head on the flattened features.

    oneDNN's convolution backward on CPU allocates reorder buffers below the dispatcher (up to
    ~45 KB here); the head's parameters are sized so that the step's peak is in the optimizer
    step (SGD momentum buffers), when no convolution kernel is running."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU(inplace=True)
        self.head = MLP((8 * 8 * 8, 256, 10))

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))  # (b, 8, 16, 16)
        x = self.relu2(self.bn2(self.conv2(x)))  # (b, 8, 8, 8)
        return self.head(x.flatten(1))  # (b, 10)


class EagerAttentionBlock(nn.Module):
    """Pre-norm transformer block with eager (materialised scores) causal attention."""

    def __init__(self, dim: int, num_heads: int, seq_len: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_norm = nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).chunk(3, dim=-1)  # each (b, s, dim)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (b, n_heads, s, head_dim)
        k = k.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))  # (b, n_heads, s, s)
        scores = scores.masked_fill(self.causal_mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v  # (b, n_heads, s, head_dim)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.w2(F.gelu(self.w1(x)))


class CheckpointedStack(nn.Module):
    """Residual MLP blocks, each recomputed in backward (non-reentrant checkpoint).

    With ``preserve_rng_state=True`` (PyTorch's default) each checkpoint call stashes
    ``torch.get_rng_state()``, a CPU byte tensor made outside the dispatcher (5056 B for the
    CPU generator): host memory that the tracer cannot see."""

    def __init__(self, dim: int, num_blocks: int, preserve_rng_state: bool = False):
        super().__init__()
        self.preserve_rng_state = preserve_rng_state
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(num_blocks))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False,
                           preserve_rng_state=self.preserve_rng_state)
        return x


class SquaredReLUFunction(torch.autograd.Function):
    """relu(x)^2 with a hand-written backward that saves the input only."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.relu().square()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.relu().mul(2)


class CustomFunctionMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(SquaredReLUFunction.apply(self.w1(x)))


class ViewsModel(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        a, b, c = self.proj(x).chunk(3, dim=-1)  # views of one (n, 3*dim) storage
        gated = b * c.sigmoid()
        joined = torch.cat([a.t().contiguous().t(), gated], dim=-1)  # (n, 2*dim)
        head = joined.narrow(0, 0, joined.shape[0] // 2)
        tail = joined.narrow(0, joined.shape[0] // 2, joined.shape[0] // 2)
        mixed = (head + tail).view(-1, joined.shape[1]).reshape(head.shape)
        return self.out(torch.cat([mixed, mixed.flip(0)], dim=0))


class RunningStatsMLP(nn.Module):
    """Updates an exponential moving average buffer under no_grad, and writes a no_grad side
    statistic into a buffer through an out= op that resizes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = MLP((dim, 2 * dim, dim))
        self.register_buffer("ema", torch.zeros(dim))
        self.register_buffer("gram", torch.zeros(0))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean(dim=0), alpha=0.1)
            torch.mm(x.t(), x, out=self.gram)  # resizes gram from 0 to (dim, dim)
        return self.mlp(x - self.ema)


class MoE(nn.Module):
    """Router + routed experts + shared expert, tokens dispatched with index_select and
    combined with index_add. Which tokens go where is an input (``token_ids``, one index
    tensor per expert), so the step has no data-dependent shapes."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP((dim, hidden, dim)) for _ in range(num_experts))
        self.shared_experts = MLP((dim, hidden, dim))

    def forward(self, x: Tensor, token_ids: list[Tensor]) -> Tensor:
        scores = self.gate(x).softmax(dim=-1)  # (tokens, num_experts)
        weights, _ = scores.topk(self.top_k, dim=-1)  # traced for its memory, not its values
        out = self.shared_experts(x)
        for e, (expert, ids) in enumerate(zip(self.experts, token_ids)):
            routed = expert(x.index_select(0, ids))  # (tokens_e, dim)
            gate = scores[:, e].index_select(0, ids).unsqueeze(-1)  # (tokens_e, 1)
            out = out.index_add(0, ids, routed * gate)
        return out + weights.sum(dim=-1, keepdim=True)


class BranchyMLP(nn.Module):
    """Tensors used by several branches, so backward sums gradients for them: in place when
    the engine holds the only reference to the first gradient (the view ``hv``), out of place
    when one gradient tensor feeds both operands of an add (``g + g``). ``w3`` runs first, so
    it keeps ``h`` alive to the end of backward and the in-place sums set the step's peak."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, dim)
        self.w3 = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        g = self.w2(x)
        g = g + g  # AddBackward passes one tensor to both inputs: summed out of place
        h = self.w1(g)  # (n, hidden)
        z = self.w3(h)  # (n, 1); saves h until the last backward Node
        hv = h.view(-1)
        # three gradients for hv (exp, then mul twice), summed in place
        return (hv * hv).sum() + hv.exp().sum() + z.sum()


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.hidden = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.output(F.silu(self.hidden(self.norm(self.embed(tokens)))))


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V2's router (softmax scores, group-limited greedy top-k: groups ranked by
    their best score, ``modeling.common.moe.Gate``) on its own. ``amax`` saves its output for
    backward, but that output only feeds ``topk``'s indices, so ``AmaxBackward0`` never runs:
    the saved output must die with the graph."""

    def __init__(self, dim: int, num_experts: int, num_groups: int, topk_group: int, top_k: int):
        super().__init__()
        self.num_groups, self.topk_group, self.top_k = num_groups, topk_group, top_k
        self.weight = nn.Parameter(torch.randn(num_experts, dim) / math.sqrt(dim))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = F.linear(x, self.weight).softmax(dim=-1)  # (T, E)
        grouped = scores.view(x.shape[0], self.num_groups, -1)  # (T, G, E / G)
        keep = grouped.amax(dim=-1).topk(self.topk_group, dim=-1)[1]  # (T, topk_group)
        mask = torch.ones(x.shape[0], self.num_groups, dtype=torch.bool,
                          device=x.device).scatter_(1, keep, False)
        masked = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        ids = masked.topk(self.top_k, dim=-1)[1]  # (T, k)
        return scores.gather(1, ids), ids


class RoutedMLP(nn.Module):
    """A group-limited router weighting one MLP per token by its top-k weight sum."""

    def __init__(self, dim: int):
        super().__init__()
        self.gate = GroupLimitedRouter(dim, num_experts=8, num_groups=4, topk_group=2, top_k=2)
        self.mlp = MLP((dim, 2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        weights, _ids = self.gate(x)  # (T, 2); the ids would pick experts
        return self.mlp(x) * weights.sum(dim=-1, keepdim=True)


class HookedMLP(MLP):
    """An MLP with the hooks training code attaches: a forward hook keeping a statistic of a
    layer's output until the next step, a full backward hook on a layer (autograd Functions
    wrapped around the module), a tensor hook replacing a gradient (clamped) and a
    post-accumulate-grad hook clipping a parameter's gradient in place."""

    def __init__(self, dims: tuple[int, ...]):
        super().__init__(dims)
        self.stats: dict[str, Tensor] = {}
        self.layers[0].register_forward_hook(self._keep_stat)
        self.layers[1].register_full_backward_hook(self._backward_hook)
        self.layers[-1].weight.register_post_accumulate_grad_hook(self._clip)

    def _keep_stat(self, module: nn.Module, args, output: Tensor) -> None:
        self.stats["layers.0"] = output.detach().abs().amax(dim=0)  # (d1,), kept a step

    @staticmethod
    def _clip(param: Tensor) -> None:
        param.grad.clamp_(-1.0, 1.0)  # in place: no new storage

    @staticmethod
    def _backward_hook(module: nn.Module, grad_input, grad_output) -> None:
        return None  # observes only; the wrapping Functions are what is measured

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers[0](x)
        h.register_hook(lambda g: g.clamp(-1.0, 1.0))  # a new gradient tensor
        for layer in self.layers[1:]:
            h = layer(F.gelu(h))
        return h


# --------------------------------------------------------------------------- builders
def _build_mlp(device: str) -> Setup:
    model = MLP((64, 256, 256, 10)).to(device)
    opt = _sgd(model)
    x = torch.randn(32, 64).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_convnet(device: str) -> Setup:
    model = ConvNet().to(device)
    opt = _sgd(model, momentum=0.9)
    x = torch.randn(4, 3, 16, 16).to(device)
    target = torch.randint(0, 10, (4,)).to(device)
    return Setup(_train_step(model, opt, lambda: F.cross_entropy(model(x), target)),
                 (model, opt, x, target))


def _build_attention(device: str) -> Setup:
    model = EagerAttentionBlock(dim=64, num_heads=4, seq_len=16).to(device)
    opt = _sgd(model)
    x = torch.randn(2, 16, 64).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_checkpoint(device: str, preserve_rng_state: bool = False) -> Setup:
    model = CheckpointedStack(dim=64, num_blocks=3, preserve_rng_state=preserve_rng_state)
    model = model.to(device)
    opt = _sgd(model)
    x = torch.randn(32, 64).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_checkpoint_rng(device: str) -> Setup:
    return _build_checkpoint(device, preserve_rng_state=True)


def _build_custom_function(device: str) -> Setup:
    model = CustomFunctionMLP(dim=64).to(device)
    opt = _sgd(model)
    x = torch.randn(32, 64).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_views(device: str) -> Setup:
    model = ViewsModel(dim=32).to(device)
    opt = _sgd(model)
    x = torch.randn(24, 32).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_adam(device: str) -> Setup:
    model = MLP((64, 128, 128, 32)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_grad_accumulation(device: str) -> Setup:
    model = MLP((48, 192, 48)).to(device)
    opt = _sgd(model, momentum=0.9)
    microbatches = [torch.randn(8, 48).to(device) for _ in range(4)]

    def step() -> None:
        for x in microbatches:
            model(x).square().mean().backward()  # .grad accumulates across microbatches
        opt.step()
    return Setup(step, (model, opt, microbatches))


def _build_no_grad_buffer(device: str) -> Setup:
    model = RunningStatsMLP(dim=32).to(device)
    opt = _sgd(model)
    x = torch.randn(16, 32).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_moe(device: str) -> Setup:
    num_experts, top_k, tokens = 4, 2, 24
    model = MoE(dim=32, hidden=64, num_experts=num_experts, top_k=top_k).to(device)
    opt = _sgd(model)
    x = torch.randn(tokens, 32).to(device)
    # A fixed, uneven routing: expert e receives tokens [e, tokens) with stride e + 1.
    token_ids = [torch.arange(e, tokens, e + 1).to(device) for e in range(num_experts)]
    return Setup(_train_step(model, opt, lambda: model(x, token_ids).square().mean()),
                 (model, opt, x, token_ids))


def _build_branchy(device: str) -> Setup:
    model = BranchyMLP(dim=8, hidden=512).to(device)
    opt = _sgd(model)
    x = torch.randn(64, 8).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).sum()), (model, opt, x))


def _build_lm(device: str) -> Setup:
    vocab = 100
    model = TinyLM(vocab=vocab, dim=32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (4, 12)).to(device)
    labels = torch.randint(0, vocab, (4 * 12,)).to(device)
    return Setup(_train_step(model, opt,
                             lambda: F.cross_entropy(model(tokens).view(-1, vocab), labels)),
                 (model, opt, tokens, labels))


def _build_saved_output_never_used(device: str) -> Setup:
    # Issue 9's input: x.amax saves its output; only topk's indices use it.
    x = torch.ones(4096, 160).to(device).requires_grad_()

    def step() -> None:
        m = x.amax(dim=-1)  # (4096,), saved by AmaxBackward0, which never runs
        idx = m.topk(2)[1]
        x.sum().backward()
        del m, idx
    return Setup(step, (x,))


def _build_group_limited_router(device: str) -> Setup:
    model = RoutedMLP(dim=32).to(device)
    opt = _sgd(model)
    x = torch.randn(24, 32).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_retain_graph(device: str) -> Setup:
    model = MLP((32, 128, 32)).to(device)
    opt = _sgd(model)
    x = torch.randn(16, 32).to(device)
    held: list[Tensor] = []

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward(retain_graph=True)  # the graph's saved tensors stay
        loss.backward()  # a second backward through the kept graph, then freed
        opt.step()
        out = model(x).square().mean()
        out.backward(retain_graph=True)  # kept with its graph until the next step
        held[:] = [out]
    return Setup(step, (model, opt, x))


def _build_hooks(device: str) -> Setup:
    model = HookedMLP((32, 128, 128, 16)).to(device)
    opt = _sgd(model)
    x = torch.randn(16, 32).to(device)
    return Setup(_train_step(model, opt, lambda: model(x).square().mean()), (model, opt, x))


def _build_training_loop(device: str) -> Setup:
    model = MLP((32, 96, 32)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)  # frees the last step's gradients
        model(x).square().mean().backward()
        opt.step()
    return Setup(step, (model, opt, x))


CASES: tuple[Case, ...] = (
    Case("mlp", _build_mlp, "3-layer GELU MLP, SGD"),
    Case("convnet_bn_inplace_relu", _build_convnet,
         "conv + batch norm + in-place ReLU, cross-entropy, SGD"),
    Case("eager_attention", _build_attention,
         "pre-norm transformer block, eager causal attention (s x s scores), SGD",
         unseen_bytes=8,
         unseen_cause="the peak is in the FFN's backward, while MulBackward0 of "
                      "`scores * (1 / sqrt(head_dim))` still holds its wrapped float64 scalar "
                      "(8 B, made below the dispatcher) for the attention's backward"),
    Case("checkpoint", _build_checkpoint,
         "3 residual MLP blocks under torch.utils.checkpoint (non-reentrant), SGD"),
    Case("checkpoint_rng_state", _build_checkpoint_rng,
         "the same with preserve_rng_state=True (PyTorch's default)",
         unseen_bytes=5056,
         unseen_cause="the peak is in the backward of blocks.0 (the last to run), while "
                      "checkpoint still holds its stash of torch.get_rng_state(), a 5056 B CPU "
                      "tensor made outside the dispatcher (host memory, not GPU memory)",
         unseen_bytes_later=3 * 5056,
         unseen_cause_later="from the second step on the gradients exist already, so the peak "
                            "moves to the backward of blocks.2 (the first to run), while all "
                            "three checkpoints still hold their 5056 B RNG-state stash"),
    Case("custom_function", _build_custom_function,
         "a custom autograd Function with save_for_backward, SGD",
         unseen_bytes=12,
         unseen_cause="the peak is `x.relu().mul(2)` in the Function's backward: "
                      + _WRAPPED_SCALAR.replace("float64 or int64", "int64"),
         unseen_bytes_later=0,
         unseen_cause_later="from the second step on the gradients exist already, so the peak "
                            "moves to w2's backward, before the Function's backward makes its "
                            "scalar"),
    Case("views_cat_chunk", _build_views, "chunk / t / cat / narrow / view / reshape, SGD"),
    Case("adam", _build_adam, "MLP, Adam (lazy state init in the first step, step tensors)",
         unseen_bytes=12,
         unseen_cause="the peak is Adam's `exp_avg_sq.sqrt() / bias_correction2_sqrt` for the "
                      "largest weight: " + _WRAPPED_SCALAR.replace("float64 or int64", "float64")),
    Case("grad_accumulation", _build_grad_accumulation,
         "4 microbatches accumulating .grad, then SGD with momentum"),
    Case("no_grad_buffer", _build_no_grad_buffer,
         "EMA buffer updated under no_grad, out= op resizing a buffer, SGD"),
    Case("moe_dispatch", _build_moe,
         "router + 4 routed experts + shared expert, index_select / index_add, SGD"),
    Case("engine_grad_sums", _build_branchy,
         "gradients summed by the autograd engine, in place and out of place, SGD"),
    Case("embedding_lm", _build_lm,
         "embedding, RMSNorm, vocabulary head, cross-entropy, AdamW",
         unseen_bytes=12,
         unseen_cause="the peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` for the "
                      "vocabulary head: " + _WRAPPED_SCALAR.replace("float64 or int64", "float64"),
         unseen_bytes_later=0,
         unseen_cause_later="from the second step on the optimizer states exist already, so the "
                            "peak moves to the cross-entropy's backward "
                            "(_log_softmax_backward_data), where no scalar is wrapped"),
    Case("saved_output_node_never_runs", _build_saved_output_never_used,
         "issue 9's input: amax's saved output feeds only topk's indices, so its backward Node "
         "never runs; x.sum().backward()"),
    Case("group_limited_router", _build_group_limited_router,
         "DeepSeek-V2's softmax, group-limited router weighting an MLP, SGD"),
    Case("retain_graph", _build_retain_graph,
         "backward twice through a retained graph, and a graph kept into the next step, SGD"),
    Case("hooks", _build_hooks,
         "forward hook keeping a statistic, full backward hook, tensor hook, "
         "post-accumulate-grad hook, SGD"),
    Case("training_loop", _build_training_loop,
         "zero_grad(set_to_none=True), forward, backward, Adam: the usual loop",
         unseen_bytes=12,
         unseen_cause="the peak is Adam's `exp_avg_sq.sqrt() / bias_correction2_sqrt` for the "
                      "largest weight: " + _WRAPPED_SCALAR.replace("float64 or int64", "float64")),
)


def get_case(name: str) -> Case:
    """The case called ``name``.

    Raises:
        KeyError: no such case; the message lists the valid names.
    """
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"unknown case {name!r}; choose from {', '.join(c.name for c in CASES)}")
