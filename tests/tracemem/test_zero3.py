"""ZeRO-3 / FSDP parameter all-gathers as traced events (tracemem.zero3).

Reference: torch 2.13's FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
pre_forward / post_forward / pre_backward / _backward_prefetch / post_backward, _fsdp_state.py
_lazy_init: the root does not reshard after forward); every byte count by hand from the
deepseek-tiny sizes (h 64, vocab 256, MLA 18,432 + norms 208 per layer, dense MLP 3 x 64 x 128,
MoE: router 8 x 64, shared 3 x 64 x 32, 8 experts 3 x 64 x 32 each), bf16 = 2 B.
"""

import dataclasses
import json

import torch

from modeling import load_config
from modeling.parallel.build import build_rank
from modeling.common.routing import parse_routing
from tracemem import estimate
from tracemem.categories import Category, Phase
from tracemem.cli import main
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryTracer
from tracemem.zero3 import Zero3Gathers

TINY = load_config("deepseek-tiny")
LAYER = 18_432 + 208  # MLA + attn_norm, ffn_norm, q_norm, kv_norm
DENSE_LAYER = LAYER + 3 * 64 * 128  # 43,216
MOE_LAYER = LAYER + 8 * 64 + 3 * 64 * 32 + 8 * 3 * 64 * 32  # 74,448
EMBED = HEAD = 256 * 64
MTP = 64 + 64 + 2 * 64 * 64 + MOE_LAYER + 64  # enorm, hnorm, eh_proj, layer, norm: 82,832
ROOT = 64  # the final norm: the only parameter outside every unit


def _gathers(events, phase):
    return [(e.action, e.nbytes) for e in events
            if e.category is Category.PARAMETER and e.phase is phase]


def test_forward_gathers_each_unit_and_frees_it_after():
    par = ParallelConfig.create(TINY, world_size=2, zero=3)
    model = build_rank(TINY, par, 0, dtype=torch.bfloat16)
    gathers = Zero3Gathers().install(model)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(model)
    with tracer:
        tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
        loss = model(tokens, tokens, parse_routing("balanced", 0))
        forward = len(tracer.events)
        loss.backward()
        gathers.end_backward()
    # the root first (kept to the end of backward), then embed and 4 layers, each gathered
    # then freed; the head (main loss), kept gathered after its forward (torchtitan's
    # reshard_after_forward=False for the output), through the loss; embed and MTP module
    # (depth 1) gathered and freed; the head's second call (MTP loss) finds it gathered
    units = [EMBED, DENSE_LAYER, DENSE_LAYER, MOE_LAYER, MOE_LAYER]
    want = ([("alloc", 2 * ROOT)] + [(a, 2 * n) for n in units for a in ("alloc", "free")]
            + [("alloc", 2 * HEAD)] + [(a, 2 * n) for n in (EMBED, MTP) for a in ("alloc", "free")])
    assert _gathers(tracer.events[:forward], Phase.FORWARD) == want
    backward = [e for e in tracer.events[forward:] if e.category is Category.PARAMETER]
    # backward gathers every unit again (layers 0-3, MTP, embed), some by prefetch; the head
    # once more (its MTP-loss backward frees it, its main-loss backward gathers it again);
    # everything is freed by the end
    allocs = sorted(e.nbytes for e in backward if e.action == "alloc")
    assert allocs == sorted(2 * n for n in [DENSE_LAYER, DENSE_LAYER, MOE_LAYER, MOE_LAYER,
                                            MTP, EMBED, HEAD])
    alive = sum(e.nbytes if e.action == "alloc" else -e.nbytes
                for e in tracer.events if e.category is Category.PARAMETER
                and e.phase is not Phase.EXTERNAL)
    assert alive == 0


# one stage without MTP and a 4096-token vocabulary, so that the head (4096 x 64) is the
# largest unit and the peak is at the loss
WIDE = dataclasses.replace(TINY, vocab_size=4096, num_mtp_modules=0)


def _rank(**kwargs):
    # the eager kernels, whose loss end (fp32 logits and log-softmax) the expected peak follows
    return estimate(WIDE, world_size=2, micro_batch_size=1, seq_length=16, num_microbatches=2,
                    zero=3, rounding=None, kernels="eager", **kwargs).ranks[0]


def test_estimate_places_the_head_gather_at_the_loss():
    head = 2 * 4096 * 64  # 524,288 B
    with_prefetch, without = _rank(), _rank(zero3_prefetch=False)
    # the peak is in the first backward, at the head: root + head gathered, and FSDP2's
    # backward prefetch adds the unit that ran before the head (layer 3, MoE)
    assert with_prefetch.peak_step == without.peak_step == "0B0"
    assert without.zero3_gather_bytes == 2 * ROOT + head
    assert with_prefetch.zero3_gather_bytes == 2 * ROOT + head + 2 * MOE_LAYER
    assert with_prefetch.peak_bytes > without.peak_bytes
    # static keeps the largest unit as its line item; the estimate does not add it again
    assert without.static.zero3_gather_bytes == head
    largest = without.largest[0]
    assert (largest["bytes"], largest["category"]) == (head, "parameter")


def test_static_reports_the_largest_unit_including_the_head(capsys):
    """Issue 9 item 4: DeepSeek-V2-Lite, world 8, EP 8, ZeRO-3: the head (102,400 x 2048 bf16)
    is the largest unit, not a decoder layer (200,811,520 B)."""
    assert main(["static", "--model", "deepseek-v2-lite", "--world-size", "8", "--ep", "8",
                 "--zero", "3", "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    assert stage["zero3_gather_bytes"] == 102_400 * 2048 * 2 == 419_430_400


# ------------------------------------------------------------ FSDP2's own buffers (issue 25)
# torch 2.13 torch/distributed/fsdp/_fully_shard/: _fsdp_collectives.py foreach_all_gather
# (copy-in, flat output), foreach_all_gather_copy_out (one buffer per parameter),
# _fsdp_param_group.py wait_for_unshard (the flat output freed after the next unit's copy-out
# in forward, at once in backward; the world-size-1 copies); torchtitan 0.3.0
# distributed/fsdp.py apply_fsdp_to_decoder ([norm, output] one unit). The small model below
# makes every byte count hand arithmetic: bf16 = 2 B.
from torch import nn  # noqa: E402

from modeling.parallel.groups import declare_fsdp_unit  # noqa: E402
from tracemem.zero3 import fsdp2_group  # noqa: E402


class _Tiny(nn.Module):
    """embed (10 x 4) -> layer: up (6 x 4), down (4 x 6) -> norm (4, the root's) -> head
    (10 x 4, kept after forward)."""

    def __init__(self):
        super().__init__()
        self.embed = declare_fsdp_unit(nn.Embedding(10, 4))
        self.layer = declare_fsdp_unit(nn.Sequential(nn.Linear(4, 6, bias=False),
                                                     nn.Linear(6, 4, bias=False)))
        self.norm = nn.RMSNorm(4)
        self.head = declare_fsdp_unit(nn.Linear(4, 10, bias=False),
                                      reshard_after_forward=False)

    def forward(self, tokens):
        return self.head(self.norm(self.layer(self.embed(tokens)))).float().sum()


def _fsdp2_events(group):
    model = _Tiny().to(device="meta", dtype=torch.bfloat16)
    gathers = Zero3Gathers(fsdp2_group=group).install(model)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    with tracer:
        loss = model(torch.zeros(1, 3, dtype=torch.long, device="meta"))
        forward = len(tracer.events)
        loss.backward()
        gathers.end_backward()
    gathers.remove()
    # the storages Zero3Gathers makes: torch.empty in a unit's hooks (the model's own ops
    # make none with aten::empty here)
    ours = {e.storage_id for e in tracer.events
            if e.action == "alloc" and e.op == "aten::empty.memory_format"}

    def of(events):
        return [(e.action, e.nbytes, e.category.value) for e in events
                if e.storage_id in ours]
    return of(tracer.events[:forward]), of(tracer.events[forward:])


def test_fsdp2_forward_holds_the_flat_all_gather_output_beside_the_parameters():
    fwd, _ = _fsdp2_events(2)
    P, C = "parameter", "comm_buffer"
    assert fwd == [
        # embed, 40 elements: copy-in 20 x 2 = 40 B, flat output 80 B, copy-in freed, the
        # weight's buffer 80 B; resharded at its post-forward (its output stays: deferred)
        ("alloc", 40, C), ("alloc", 80, C), ("free", 40, C), ("alloc", 80, P),
        ("free", 80, P),
        # layer, 24 + 24 elements: copy-in 48 B, output 96 B, copy-in freed, up and down 48 B
        # each; only then the embed's output freed (the end of the layer's wait_for_unshard);
        # the layer resharded at its post-forward
        ("alloc", 48, C), ("alloc", 96, C), ("free", 48, C), ("alloc", 48, P),
        ("alloc", 48, P), ("free", 80, C), ("free", 48, P), ("free", 48, P),
        # [norm, head] gathered at the norm (the root's 4 elements first, then 40): copy-in
        # (2 + 20) x 2 = 44 B, output 88 B, the norm's 8 B and the head's 80 B buffers (kept
        # after forward), the layer's output freed; the root's post-forward, placed after
        # the head, frees the unit's output
        ("alloc", 44, C), ("alloc", 88, C), ("free", 44, C), ("alloc", 8, P),
        ("alloc", 80, P), ("free", 96, C), ("free", 88, C)]
    # during the layer's copy-out: its output and its buffers (2 x 96 B) and the embed's 80 B


def test_fsdp2_backward_prefetches_the_all_gather_and_copies_out_at_use():
    _, bwd = _fsdp2_events(2)
    P, C, G = "parameter", "comm_buffer", "gradient"
    assert bwd == [
        # the head's pre-backward (still gathered) prefetches the layer: all-gather issued
        ("alloc", 48, C), ("alloc", 96, C), ("free", 48, C),
        # [norm, head] resharded after the norm's backward (its post-backward hook is on the
        # norm's input)
        ("free", 80, P), ("free", 8, P),
        # then its gradient reduce-scatter input (foreach_reduce): fp32, every unsharded
        # gradient, (4 + 40) x 4 = 176 B, and the reduce output, the fp32 sharded gradients
        # (half of it, 88 B), kept as the step's gradients
        ("alloc", 176, C), ("alloc", 88, G),
        # the layer's pre-backward: copy-out, the output freed at once (backward), then the
        # embed prefetched
        ("alloc", 48, P), ("alloc", 48, P), ("free", 96, C),
        ("alloc", 40, C), ("alloc", 80, C), ("free", 40, C),
        # the layer's post-backward: resharded, the previous reduce-scatter input released
        # (reduce_scatter_max_input_buffers 1), its own made: (24 + 24) x 4 = 192 B, and its
        # sharded gradients 96 B
        ("free", 48, P), ("free", 48, P), ("free", 176, C), ("alloc", 192, C),
        ("alloc", 96, G),
        # the embed's pre-backward copies out; the root's final callback (queued on the
        # autograd engine at the first pre-backward) runs its post-backward (its inputs need
        # no gradient): reshard, the layer's reduce-scatter input released, the embed's made
        # (40 x 4 = 160 B) and its sharded gradient 80 B; then the last input released. The
        # sharded gradients stay (until zero_grad)
        ("alloc", 80, P), ("free", 80, C), ("free", 80, P), ("free", 192, C),
        ("alloc", 160, C), ("alloc", 80, G), ("free", 160, C)]


def test_fsdp2_world_size_1_copies_each_parameter_from_its_cast():
    fwd, _ = _fsdp2_events(1)
    P, T = "parameter", "temporary"
    # nothing all-gathered; per parameter its bf16 cast (the whole parameter), then the cast
    # before it freed (the loop variable rebound), then its unsharded buffer; the last cast
    # freed when wait_for_unshard returns
    assert fwd == [
        ("alloc", 80, T), ("alloc", 80, P), ("free", 80, T), ("free", 80, P),  # embed
        ("alloc", 48, T), ("alloc", 48, P), ("alloc", 48, T), ("free", 48, T),  # layer
        ("alloc", 48, P), ("free", 48, T), ("free", 48, P), ("free", 48, P),
        ("alloc", 8, T), ("alloc", 8, P), ("alloc", 80, T), ("free", 8, T),  # norm, head
        ("alloc", 80, P), ("free", 80, T)]


def test_fsdp2_buffers_pad_dim_0_to_the_group():
    # FSDPParam.padded_sharded_param_size: a (10, 4) weight over 4 ranks is 3 rows a rank,
    # so the copy-in is 3 x 4 x 2 = 24 B and the flat output and the buffer 4 x 24 = 96 B
    fwd, _ = _fsdp2_events(4)
    assert fwd[:4] == [("alloc", 24, "comm_buffer"), ("alloc", 96, "comm_buffer"),
                       ("free", 24, "comm_buffer"), ("alloc", 96, "parameter")]


def test_fsdp2_group_only_for_the_fsdp2_recipe():
    # Megatron's ZeRO-3 / Megatron-FSDP keep one flat buffer per gather (no fsdp2_group)
    assert fsdp2_group(ParallelConfig.create(TINY, world_size=2, zero=3)) is None
    assert fsdp2_group(ParallelConfig.create(TINY, world_size=2, zero=3,
                                             precision="fsdp2")) == 2
    # the group is the dense parameters' shard group, DP x CP (tracemem.parallel.SHARDING)
    assert fsdp2_group(ParallelConfig.create(TINY, world_size=4, zero=3, cp=2,
                                             precision="fsdp2")) == 4
    assert Zero3Gathers.for_layout(ParallelConfig.create(TINY, world_size=2,
                                                         zero=3)).fsdp2_group is None


def test_fsdp2_frees_each_units_bf16_gradients_at_its_post_backward():
    # foreach_reduce: the unsharded gradients are copied into the reduce-scatter input and
    # freed (unsharded_grads.clear()) at each unit's post-backward; the embed's (inputs that
    # need no gradient) at the root's final callback, which FSDPState._pre_backward queues on
    # the autograd engine (_register_root_post_backward_final_callback), so inside backward()
    model = _Tiny().to(device="meta", dtype=torch.bfloat16)
    gathers = Zero3Gathers(fsdp2_group=2).install(model)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    with tracer:
        model(torch.zeros(1, 3, dtype=torch.long, device="meta")).backward()
        left = {name for name, p in model.named_parameters() if p.grad is not None}
    # the sharded gradients, one flat fp32 buffer a unit (dim 0 padded to 2): [norm, head]
    # (4 + 40) / 2, the layer (24 + 24) / 2, the embed 40 / 2 elements
    held = {name: g.numel() for name, g in gathers.sharded_grads.items()}
    gathers.remove()
    assert left == set()
    assert held == {"head": 22, "layer": 24, "embed": 20}
    gathers.zero_grad()
    assert gathers.sharded_grads == {}


def test_fsdp2_later_backwards_accumulate_into_the_first_ones_gradients():
    # a second backward in the step (gradient accumulation): foreach_reduce's output is
    # added into sharded_param.grad in place and freed when it returns; zero_grad (the next
    # step) drops the gradients, and the backward after it makes them again
    first, second, third = _sharded_gradient_events(replicas=1, zero_grad_before_third=True)
    assert first == [("alloc", 88), ("alloc", 96), ("alloc", 80)]
    assert second == [
        ("alloc", 88), ("free", 88), ("alloc", 96), ("free", 96), ("alloc", 80), ("free", 80)]
    # zero_grad frees the three; the third backward makes them again
    assert third == [
        ("free", 88), ("free", 96), ("free", 80), ("alloc", 88), ("alloc", 96), ("alloc", 80)]


def _sharded_gradient_events(replicas: int, zero_grad_before_third: bool = False):
    """_Tiny under FSDP2 over 2 ranks (``replicas`` HSDP replicas): (action, bytes) of the
    fp32 sharded gradients Zero3Gathers makes, in each of three backwards (zero_grad before
    the third when asked)."""
    model = _Tiny().to(device="meta", dtype=torch.bfloat16)
    gathers = Zero3Gathers(fsdp2_group=2, replicas=replicas).install(model)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    tokens = torch.zeros(1, 3, dtype=torch.long, device="meta")
    bounds = []
    with tracer:
        for step in range(3):
            if step == 2 and zero_grad_before_third:
                gathers.zero_grad()
            model(tokens).backward()
            bounds.append(len(tracer.events))
    gathers.remove()
    ours = {e.storage_id for e in tracer.events if e.action == "alloc"
            and e.category is Category.GRADIENT and e.op == "aten::empty.memory_format"}
    starts = [0] + bounds[:-1]
    return [[(e.action, e.nbytes) for e in tracer.events[a:b] if e.storage_id in ours]
            for a, b in zip(starts, bounds)]


def test_fsdp2_world_size_1_divides_into_one_fp32_quotient():
    # world size 1: reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)
    # (torchtitan's factor 1.0): a temporary of every gradient in fp32 after the input
    _, bwd = _fsdp2_events(1)
    reduce = [e for e in bwd if e[1] in (176, 192, 160)]  # the bf16 buffers: 8 to 96 B
    # [norm, head] (4 + 40) x 4 = 176 B; the layer (24 + 24) x 4 = 192 B; the embed 160 B
    # each with its reduce output (the sharded gradients, all of it at world size 1) made
    # between the input and the quotient, and kept
    C, G, T = "comm_buffer", "gradient", "temporary"
    assert reduce == [("alloc", 176, C), ("alloc", 176, G), ("alloc", 176, T), ("free", 176, T),
                      ("free", 176, C), ("alloc", 192, C), ("alloc", 192, G),
                      ("alloc", 192, T), ("free", 192, T),
                      ("free", 192, C), ("alloc", 160, C), ("alloc", 160, G),
                      ("alloc", 160, T), ("free", 160, T), ("free", 160, C)]


def test_fsdp2_estimate_replays_the_gradients_the_trace_makes():
    # zero_grad(set_to_none=True) (torchtitan's --training.disable_cuda_graphs). llama-tiny (h 64, 4 heads of 16, 2 KV heads, MLP 128, 4 layers, vocabulary 256; the
    # torch profile's fused wqkv (4 + 2 x 2) x 16 = 128 rows): 180,800 parameters, every
    # dim 0 a multiple of 4, so FSDP2 over 4 ranks pads nothing: 45,200 a rank. Two
    # microbatches (G 8 = b 1 x DP 4 x 2): the first backward makes the fp32 sharded
    # gradients, 45,200 x 4 = 180,800 B, the second adds into them; none is in static memory
    from tracemem.estimator import TraceCache, floor_bytes, rank_classes, replay_events, \
        trace_classes
    from tracemem.job import Job

    job = Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
              global_batch_size=8, zero=3, precision="fsdp2", kernels="torch",
              kernel_options={"zero_grad_set_to_none": True})  # disable_cuda_graphs
    traced, = trace_classes(job, rank_classes(job), TraceCache())
    static = traced.static
    assert static.traced_grad_bytes == static.grad_bytes == 4 * 45_200
    # the floor: fp32 parameters 4 B and AdamW's two fp32 moments 8 B per sharded element
    assert floor_bytes(static) == 12 * 45_200 + static.buffer_bytes + static.workspace_bytes
    assert not traced.segments.transient_grads
    live: dict = {}
    for _, key, action, nbytes, event in replay_events(traced.steps, 1, traced.segments):
        if action == "alloc":
            live[key] = event
        else:
            live.pop(key, None)
    # after the optimizer step: microbatch 0's, once: one flat buffer a unit, each rounded
    # to the trace's 512 B: the embedding 256 x 64 / 4 x 4 = 16,384; a layer 36,992 / 4 x 4
    # = 36,992 -> 37,376; [norm, head] (64 + 16,384) / 4 x 4 = 16,448 -> 16,896
    grads = sum(e.nbytes for e in live.values() if e.category is Category.GRADIENT)
    assert grads == 16_384 + 4 * 37_376 + 16_896 == 182_784
    assert {key[1] for key, e in live.items() if e.category is Category.GRADIENT} == {0}


def test_hsdp_holds_a_later_backwards_reduce_outputs_to_the_end_of_backward():
    # HSDP (torch 2.13 foreach_reduce's all-reduce branch: all_reduce_input = reduce_output,
    # held by the unit's _all_reduce_state until FSDPParamGroup.finalize_backward): in the
    # step's first backward the reduce outputs are the gradients (nothing more); in a second
    # one each unit's output (88, 96 and 80 B, as above) stays until the end of backward
    first, second, _ = _sharded_gradient_events(replicas=2)
    assert first == [("alloc", 88), ("alloc", 96), ("alloc", 80)]
    assert second == [("alloc", 88), ("alloc", 96), ("alloc", 80), ("free", 88), ("free", 96),
                      ("free", 80)]


def test_fsdp2_gradients_kept_between_steps_by_default():
    # torchtitan's default zero_grad(set_to_none=False) (trainer.py: set_to_none =
    # training.disable_cuda_graphs, False): the sharded gradients stay, zeroed, from the last
    # step, static memory; every backward's reduce output (the same 16,384 + 4 x 37,376 +
    # 16,896 B, rounded to 512 B) is added into them and freed, so none is alive after the step
    from tracemem.estimator import TraceCache, floor_bytes, rank_classes, replay_events, \
        trace_classes
    from tracemem.job import Job

    job = Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
              global_batch_size=8, zero=3, precision="fsdp2", kernels="torch")
    traced, = trace_classes(job, rank_classes(job), TraceCache())
    static = traced.static
    assert static.traced_grad_bytes == 0 and static.held_grad_bytes == 4 * 45_200
    assert floor_bytes(static) == 16 * 45_200 + static.buffer_bytes + static.workspace_bytes
    made = freed = 0
    live: dict = {}
    for _, key, action, nbytes, event in replay_events(traced.steps, 1, traced.segments):
        if event.category is Category.GRADIENT and event.op == "aten::empty.memory_format":
            made += nbytes if action == "alloc" else 0
        if action == "alloc":
            live[key] = event
        else:
            live.pop(key, None)
    assert made == 2 * (16_384 + 4 * 37_376 + 16_896)  # two microbatches' reduce outputs
    assert not any(e.category is Category.GRADIENT for e in live.values())
