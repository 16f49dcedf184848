"""Transformer Engine's CPU offloading of N layers (``modeling.common.cpu_offload``, Megatron's
``--cpu-offloading-num-layers``).

References: TransformerEngine d0067d0 (identical at v2.17.1 and v2.18)
transformer_engine/pytorch/cpu_offload.py (``DefaultOffloadSynchronizer``,
``OffloadableLayerState``), read for each expected value below; Megatron-LM d98e8a6
transformer_config.py ``TransformerConfig.__post_init__`` for the refusals. Hand arithmetic:
bytes = numel x element size (float32 4 B, bf16 2 B); TE offloads a saved tensor of at least
256 x 1024 elements.
"""

import pytest
import torch

from modeling.common import cpu_offload
from modeling.common.cpu_offload import MIN_OFFLOAD_NUMEL, Synchronizer
from modeling.common.offload import HostBuffer
from tracemem import Category, Job, MemoryTracer, Phase, TracememError, estimate

N = MIN_OFFLOAD_NUMEL  # elements of the tensor each toy layer saves
B = 4 * N  # its bytes (float32)


class _Save(torch.autograd.Function):
    """A toy layer: a new output of the input's size; saves its input and a 16-element
    tensor (below TE's minimum: never offloaded)."""

    @staticmethod
    def forward(ctx, x):
        small = x.new_empty(16)
        ctx.save_for_backward(x, small)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, small = ctx.saved_tensors
        assert x.shape == (N,) and small.shape == (16,)
        return grad.new_empty(grad.shape)


def _run(num_layers: int, offloaded: int):
    """``num_layers`` toy layers under TE's synchronizer, as TransformerBlock.forward runs
    them; returns the tracer, the synchronizer and the device bytes as each layer's forward
    starts (after its ``fwd_step``), after the last and after the backward."""
    leaf = torch.empty(N, device="meta", requires_grad=True)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(leaf)
    sync = Synchronizer(num_layers, offloaded) if offloaded else None
    before = []
    with tracer:
        h = leaf * 1  # layer 0's input: a non-leaf, held by nothing but the layer
        with cpu_offload.synchronizer(sync):
            for _ in range(num_layers):
                with cpu_offload.layer():  # fwd_step: offloads and releases first
                    before.append(tracer.current_bytes - tracer.baseline_bytes)
                    h = _Save.apply(h)
                h = cpu_offload.synchronize(h)
        before.append(tracer.current_bytes - tracer.baseline_bytes)
        h.sum().backward()
        del h
        before.append(tracer.current_bytes - tracer.baseline_bytes)  # after the backward
    return tracer, sync, before


def _small(count: int) -> int:
    return count * 16 * 4


def test_without_offloading_every_layer_keeps_its_input():
    _, _, before = _run(4, 0)
    # before layer i: i + 1 inputs / outputs of B bytes (x0, y0..y_{i-1}) and i small tensors
    assert before == [B + _small(0), 2 * B + _small(1), 3 * B + _small(2), 4 * B + _small(3),
                      5 * B + _small(4), B]  # after the backward: the leaf's gradient


def test_layer_j_leaves_the_device_before_layer_l_minus_n_plus_j():
    tracer, sync, before = _run(4, 2)
    # L = 4, N = 2: finish_offload_map {2: [0], 3: [1]}: x0 (layer 0's saved input) is
    # dropped at layer 2's fwd_step, x1 = y0 at layer 3's; small tensors stay
    assert before[:5] == [B + _small(0), 2 * B + _small(1), 3 * B + _small(2) - B,
                          4 * B + _small(3) - 2 * B, 5 * B + _small(4) - 2 * B]
    # a pinned host copy of each offloaded tensor, made at the next layer's fwd_step
    assert sync.host == [HostBuffer((N,), torch.float32, B, False)] * 2
    # start_reload_map {1: [0], 2: [1]}: in backward two reloads of B bytes, activations,
    # each freed with its layer's release_all_memory (the next layer's bwd_step, or the
    # final callback for layer 0)
    reloads = [e for e in tracer.events if e.phase is Phase.BACKWARD and e.action == "alloc"
               and e.nbytes == B and e.category is Category.ACTIVATION]
    assert len(reloads) == 2
    assert before[5] == B  # after the backward: the leaf's gradient, nothing else


def test_the_backward_reloads_each_layer_before_it_is_needed():
    tracer, _, _ = _run(3, 1)
    # L = 3, N = 1: layer 0 reloaded at bwd_step(1): after layer 2's backward (its input
    # gradient, B bytes), before layer 1's (the next gradient)
    back = [(e.action, e.nbytes, e.category) for e in tracer.events
            if e.phase is Phase.BACKWARD and e.nbytes == B]
    reload = back.index(("alloc", B, Category.ACTIVATION))
    grads = [i for i, (action, _, category) in enumerate(back)
             if action == "alloc" and category is not Category.ACTIVATION]
    assert len(grads) >= 3 and grads[0] < reload < grads[1]


def test_te_refuses_to_offload_every_layer():
    with pytest.raises(TracememError, match="give 1 to 3 for a block of 4 layers"):
        Synchronizer(4, 4)


def test_a_small_or_non_contiguous_tensor_stays_saved_as_usual():
    sync = Synchronizer(2, 1)
    with cpu_offload.synchronizer(sync), cpu_offload.layer():
        small = torch.empty(N - 1, device="meta")
        strided = torch.empty(2 * N, device="meta")[::2]
        param = torch.nn.Parameter(torch.empty(N, device="meta"))
        for t in (small, strided, param):
            assert isinstance(sync.push(t), torch.Tensor)
        assert isinstance(sync.push(torch.empty(N, device="meta")), tuple)


def test_a_view_of_its_base_size_and_duplicates_go_to_the_host_once():
    sync = Synchronizer(2, 1)
    base = torch.empty(N, device="meta")
    view = base.view(2, N // 2)  # same elements: offloaded as the base (_switch_to_base_tensors)
    with cpu_offload.synchronizer(sync):
        with cpu_offload.layer():
            packed = [sync.push(view), sync.push(base), sync.push(view)]
        with cpu_offload.layer():  # fwd_step(1): layer 0's start_offload
            pass
    assert sync.host == [HostBuffer((N,), torch.float32, B, False)]
    sync.bwd_step(0)  # start_reload_map {0: [0]} for L = 2, N = 1
    shapes = [tuple(sync.pop(p).shape) for p in packed]
    assert shapes == [(2, N // 2), (N,), (2, N // 2)]


# ------------------------------------------------------------------ the Job and the estimate
def _job(**kw):
    kw = {**dict(model="llama-tiny", world_size=1, micro_batch_size=1, seq_length=4096,
                 global_batch_size=2, kernels="megatron-te"), **kw}
    return Job(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(cpu_offloading_num_layers=4), "only for layers less than 4"),
    (dict(cpu_offloading_num_layers=-1), "is invalid"),
    (dict(cpu_offloading_num_layers=True), "is invalid"),
    (dict(cpu_offloading_num_layers=1, pp=2, world_size=2), "with --pp 2: currently there is "
                                                             "no support for pipeline"),
    (dict(cpu_offloading_num_layers=1, recompute="full"), "activation recomputation"),
    (dict(cpu_offloading_num_layers=1, fine_grained_activation_offloading=True,
          offload_modules=("core_attn",)), "cannot be enabled with"),
])
def test_the_job_refuses_what_megatron_refuses(kw, message):
    with pytest.raises(TracememError, match=message):
        _job(**kw)


def test_other_kernels_are_refused():
    with pytest.raises(TracememError, match="use --kernels megatron-te"):
        Job(model="gpt-tiny", world_size=1, micro_batch_size=1, seq_length=64,
            global_batch_size=1, kernels="torch", cpu_offloading_num_layers=1)


@pytest.mark.parametrize("n", [1, 3])
def test_llama_tiny_moves_its_first_layers_saved_tensors_to_the_host(n):
    off, on = estimate(_job()), estimate(_job(cpu_offloading_num_layers=n))
    rank_off, rank_on = off.ranks[0], on.ranks[0]
    # llama-tiny (h 64, 4 heads of 16, 2 KV heads, SwiGLU of 2 x 128) at s = 4096, b = 1:
    # what TE offloads of a layer (>= 256 Ki elements), by hand from its saves:
    # linear_qkv (LayerNormLinear) its input and ln_out, (s, h) bf16: 2 x 512 KiB;
    # fused attention q (s, 4, 16): 512 KiB, and its out, which linear_proj saves as a view
    # of the same size (one base, deduplicated): 512 KiB; k and v (s, 2, 16) have 128 Ki
    # elements and stay; linear_fc1 (LayerNormLinear) input and ln_out: 2 x 512 KiB; the
    # SwiGLU input (s, 256): 2 MiB; linear_fc2's input (s, 128): 1 MiB. 6 MiB a layer, each
    # a pinned block of a power of two already
    per_layer = 6 * 512 * 1024 + 2 * 2**20 + 2**20
    assert rank_off.host_bytes == 0
    assert rank_on.host_bytes == rank_on.host_pinned_bytes == n * per_layer
    # the peak is the forward's end (the loss), where the N layers are off the device
    assert rank_off.peak_step == rank_on.peak_step == "0F0"
    assert rank_off.peak_bytes - rank_on.peak_bytes == n * per_layer
    assert on.job.settings()["cpu_offloading_num_layers"] == n


def test_offloading_that_moves_nothing_says_so():
    from tracemem.report import format_host_memory, get_estimate

    # s = 1024: a (s, b, h) tensor has 64 Ki elements, the SwiGLU input 256 Ki (offloaded);
    # at s = 256 nothing reaches TE's 256 Ki elements: the estimate is the one without it
    small = dict(seq_length=256)
    off, on = estimate(_job(**small)), estimate(_job(cpu_offloading_num_layers=2, **small))
    assert on.ranks[0].peak_bytes == off.ranks[0].peak_bytes and on.ranks[0].host_bytes == 0
    line = format_host_memory(get_estimate(on)["verdict"], "B")
    assert line.startswith("Host memory: none; --cpu-offloading-num-layers moves nothing of "
                           "this job to the host")
    assert format_host_memory(get_estimate(off)["verdict"], "B") is None
