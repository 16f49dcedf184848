"""Megatron-Core's fine-grained activation offloading on meta (``modeling.common.offload``).

References: Megatron-LM 4e85d74ae9 megatron/core/pipeline_parallel/
fine_grained_activation_offload.py (``ChunkOffloadHandler``, ``PipelineOffloadManager``), read
for each expected value below; hand arithmetic, bytes = numel x element size (float32 4 B).
"""

from collections import namedtuple

import pytest
import torch

from modeling.common.offload import (ChunkHandler, ChunkPlan, HostBuffer, chunk, commit, group,
                                     offload_plan)
from tracemem import Category, MemoryTracer, Phase, TracememError

Step = namedtuple("Step", "kind stage microbatch")


def _steps(text: str) -> list[Step]:
    """``"F0 B0 F1"``: kind, then the microbatch (virtual stage 0); ``"F1.3"``: stage 1, mb 3."""
    out = []
    for token in text.split():
        stage, _, mb = token[1:].rpartition(".")
        out.append(Step(token[0], int(stage or 0), int(mb)))
    return out


def _run(handler, saved_numel=32, release=False):
    """Under the tracer: ``t = x * 2`` (a temporary of ``saved_numel`` floats) inside group "g",
    whose ``sin`` saves it; the commit on ``sin``'s output; then the backward."""
    x = torch.empty(saved_numel, device="meta", requires_grad=True)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(x)
    after = {}
    with tracer:
        u = x * 3  # outside the group: released at the commit when ``release``
        with chunk(handler):
            with group("g", u) as ua:
                t = ua * 2
                y = t.sin()  # saves t
            del t
            after["before commit"] = tracer.current_bytes - tracer.baseline_bytes
            y = commit(y, "g", [ua] if release else [])
            after["after commit"] = tracer.current_bytes - tracer.baseline_bytes
        y.sum().backward()
    return tracer, after


def test_a_group_sends_what_it_saves_to_the_host_and_reloads_it_in_backward():
    handler = ChunkHandler({"g"}, min_size=16)
    tracer, after = _run(handler)
    # u, t, y: 3 x 128 B; at the commit t (saved by sin only) goes to the host, its storage dies
    assert after == {"before commit": 3 * 128, "after commit": 2 * 128}
    assert handler.host == [HostBuffer((32,), torch.float32, 128, True)]
    # in backward the group start reloads it (bulk_reload): one new 128 B device activation
    reloads = [e for e in tracer.events if e.phase is Phase.BACKWARD and e.action == "alloc"
               and e.category is Category.ACTIVATION]
    assert [(e.nbytes, e.shape) for e in reloads] == [(128, (32,))]


def test_a_tensor_below_the_minimum_size_stays_on_the_device():
    handler = ChunkHandler({"g"}, min_size=33)  # 32 elements < 33
    _, after = _run(handler)
    assert after == {"before commit": 3 * 128, "after commit": 3 * 128}
    assert handler.host == []


def test_forced_released_tensors_lose_their_storage_at_the_commit():
    # the group's input u is still referenced, but its storage is resize_(0)-ed
    handler = ChunkHandler({"g"}, min_size=16)
    _, after = _run(handler, release=True)
    assert after == {"before commit": 3 * 128, "after commit": 128}


def test_a_kept_group_offloads_nothing_and_a_module_not_named_is_the_identity():
    kept = ChunkHandler({"g"}, min_size=16, plan=ChunkPlan(keep=frozenset({0})))
    _, after = _run(kept)
    assert after["after commit"] == 3 * 128 and kept.host == []
    other = ChunkHandler({"h"}, min_size=16)  # "g" not in --offload-modules
    _, after = _run(other)
    assert after["after commit"] == 3 * 128 and other.groups == []


def test_a_group_out_of_the_predicted_order_raises():
    handler = ChunkHandler({"g"}, min_size=16, expected=("h",))
    with pytest.raises(RuntimeError, match="group 0 is 'g', Block.offload_groups predicted 'h'"):
        _run(handler)


# ------------------------------------------------------------------ offload_plan by hand
def test_plan_of_the_first_iteration_offloads_everything():
    # warm-up: every group offloaded (is_warmup), and no group start finds its own stack empty
    # before it has reloaded its own (G groups, G offloaded), so nothing is reloaded early
    plans = offload_plan(_steps("F0 F1 B0 F2 B1 F3 B2 B3"), [["a", "b"]], lambda v: v,
                         warmup=True)
    assert set(plans.values()) == {ChunkPlan(frozenset(), 0)}


def test_plan_of_a_first_stage_after_the_warm_up():
    # PP 2, stage 0, 1F1B, M = 4, one chunk with groups a, b:
    # post_warmup_callback: the earliest backward chunk, mb 0, keeps its last a and last b
    # (_offload_margin 2); should_bulk_offload: at F0 the next backward chunk is mb 0 itself
    # (the same groups); F1, F2, F3 are not the next to run backward. In backward mb 0 pops
    # nothing of its own (0 offloaded), so its 2 group starts reload mb 1's 2 groups (F1 has
    # run); mb 1 then has 0 of its own left, and reloads mb 2's; mb 2 reloads mb 3's
    plans = offload_plan(_steps("F0 F1 B0 F2 B1 F3 B2 B3"), [["a", "b"]], lambda v: v)
    assert plans == {(0, 0): ChunkPlan(frozenset({0, 1}), 0),
                     **{(0, m): ChunkPlan(frozenset(), 2) for m in (1, 2, 3)}}


def test_plan_of_a_last_stage_after_the_warm_up():
    # PP 2, stage 1: F m then B m. Every forward is of the next chunk to run backward, so
    # each keeps its last group of each name (layers: a b a b -> indices 2, 3); a backward's
    # spare group starts find the next chunk's forward not yet run: nothing reloaded early
    plans = offload_plan(_steps("F0 B0 F1 B1 F2 B2"), [["a", "b", "a", "b"]], lambda v: v)
    assert set(plans.values()) == {ChunkPlan(frozenset({2, 3}), 0)}


def test_plan_of_the_megatron_ci_case_logged_rank():
    # gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading: PP 2,
    # VPP 4, M = 4, rank 1 holds virtual stages 1, 3, 5, 7 (chunks 0-2: two MoE layers of 7
    # groups each; chunk 3: the loss, no groups). Megatron's backward queue: mb 0, 1 of chunk
    # 3, then of 2, 1, 0, then mb 2, 3 likewise. The earliest backward chunk with groups is
    # (chunk 2, mb 0): it keeps its last layer's 7 groups; every later backward chunk gets 7
    # groups reloaded by the previous one's 7 spare group starts (its forward has run)
    layer = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
             "moe_act"]
    steps = _steps("F1.0 F1.1 F3.0 F3.1 F5.0 F5.1 F7.0 B7.0 F7.1 B7.1 F1.2 B5.0 F1.3 B5.1 "
                   "F3.2 B3.0 F3.3 B3.1 F5.2 B1.0 F5.3 B1.1 F7.2 B7.2 F7.3 B7.3 B5.2 B5.3 "
                   "B3.2 B3.3 B1.2 B1.3")
    plans = offload_plan(steps, [layer * 2] * 3 + [[]], lambda v: v // 2)
    assert plans[(2, 0)] == ChunkPlan(frozenset(range(7, 14)), 0)
    assert all(plans[(c, m)] == ChunkPlan(frozenset(), 7)
               for c in range(3) for m in range(4) if (c, m) != (2, 0))
    assert all(plans[(3, m)] == ChunkPlan() for m in range(4))


def test_plan_refuses_a_backward_order_other_than_the_queue():
    with pytest.raises(ValueError, match="backward order is not the order"):
        offload_plan(_steps("F0 F1 B1 B0"), [["a"]], lambda v: v)


# ------------------------------------------------------------------ the Job and its estimate
def _job(mtp=0, **kw):
    from dataclasses import replace

    from modeling import load_config
    from tracemem.job import Job

    cfg = replace(load_config("deepseek-tiny"), num_mtp_modules=mtp)
    return Job(model=cfg, world_size=2, pp=2, micro_batch_size=1, seq_length=64,
               num_microbatches=4, rounding=0, **kw)


MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
           "moe_act")


def test_an_unreachable_minimum_size_changes_nothing():
    # no saved tensor has 2^40 elements: nothing offloaded or released, the same peaks
    from tracemem.estimator import estimate

    plain = estimate(_job())
    off = estimate(_job(fine_grained_activation_offloading=True, offload_modules=MODULES,
                        min_offloaded_tensor_size=2**40))
    assert [r.peak_bytes for r in off.ranks] == [r.peak_bytes for r in plain.ranks]
    assert [r.host_bytes for r in off.ranks] == [0, 0]


@pytest.mark.parametrize("mtp", [0, 1])
def test_offloading_lowers_the_peak_and_fills_the_host(mtp):
    # with MTP the last chunk's groups go on with the MTP layer's (the trace checks the order)
    from tracemem.estimator import estimate

    plain = estimate(_job(mtp=mtp))
    off = estimate(_job(mtp=mtp, fine_grained_activation_offloading=True,
                        offload_modules=MODULES, min_offloaded_tensor_size=0))
    assert all(o.peak_bytes < p.peak_bytes for o, p in zip(off.ranks, plain.ranks))
    assert all(r.host_bytes > 0 and r.host_pinned_bytes == r.host_bytes for r in off.ranks)


@pytest.mark.parametrize("kw, message", [
    (dict(offload_modules=("core_attn",)), "--offload-modules needs --fine-grained"),
    (dict(min_offloaded_tensor_size=1024), "--min-offloaded-tensor-size needs --fine-grained"),
    (dict(fine_grained_activation_offloading=True), "needs --offload-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("attn_proj",)),
     "attn_proj cannot be set alone without core_attn"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("fused_group_mlp",)),
     "d98e8a6's"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("qkv",)),
     "--offload-modules qkv is invalid; choose from attn_norm"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("moe_act",),
          kernels="torch"), "only supported with the transformer_engine implementation"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("moe_act",),
          recompute="full"), "with --recompute full is not modelled"),
    (dict(fine_grained_activation_offloading=True, offload_modules=("moe_act",),
          min_offloaded_tensor_size=-1), "--min-offloaded-tensor-size -1 is invalid"),
])
def test_the_job_refuses_by_name(kw, message):
    with pytest.raises(TracememError, match=message):
        _job(**kw)


def test_megatron_arguments_reach_the_job():
    from tracemem.frontdoors.megatron import megatron_job_kwargs

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--bf16", "--vocab-size", "128"]
    kw = megatron_job_kwargs(base + ["--fine-grained-activation-offloading",
                                     "--offload-modules", "attn_norm", "core_attn",
                                     "--min-offloaded-tensor-size", "1000"], world_size=8)
    assert (kw["fine_grained_activation_offloading"], kw["offload_modules"],
            kw["min_offloaded_tensor_size"]) == (True, ("attn_norm", "core_attn"), 1000)
    with pytest.raises(TracememError, match="--activation-offload-fraction 0.5: not modelled"):
        megatron_job_kwargs(base + ["--fine-grained-activation-offloading", "--offload-modules",
                                    "core_attn", "--activation-offload-fraction", "0.5"],
                            world_size=8)


@pytest.mark.parametrize("recompute", ["core_attn", "layernorm"])
def test_grouped_query_attention_has_no_attn_norm_group_and_no_core_attn_one_when_recomputed(
        recompute):
    # Megatron's TE spec fuses the input norm into linear_qkv (IdentityOp: no attn_norm group)
    # and the dense pre-MLP norm into fc1 (no mlp_norm group); core_attn recompute runs
    # _checkpointed_attention_forward, outside any group. The trace checks the groups it starts
    # against Block.offload_groups
    from modeling.common.block import Block
    from modeling.parallel.build import build_rank
    from tracemem.estimator import estimate
    from tracemem.job import Job

    job = Job(model="llama-tiny", world_size=1, micro_batch_size=1, seq_length=64,
              num_microbatches=2, recompute="selective", recompute_modules=(recompute,),
              fine_grained_activation_offloading=True, offload_modules=MODULES[:5],
              min_offloaded_tensor_size=0)
    block = next(m for m in build_rank(job.config, job.parallel, 0, kernels=job.profile,
                                       dtype=torch.bfloat16).modules() if isinstance(m, Block))
    block.set_recompute("selective", frozenset({recompute}))
    assert block.offload_groups(set(MODULES)) == (
        ["qkv_linear", "attn_proj"] if recompute == "core_attn"
        else ["qkv_linear", "core_attn", "attn_proj"])
    assert estimate(job).ranks[0].host_bytes > 0


def test_typed_offload_flags_over_a_megatron_job_without_them_are_named(tmp_path, capsys):
    # the Megatron job offloads nothing (the front door sets no offload field): tracemem's
    # typed flags change it, and the override note says so
    from tracemem.cli import main

    args = tmp_path / "base.args"
    args.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 "
                    "--bf16 --vocab-size 128\n")
    assert main(["estimate", "--world-size", "2", "--quiet",
                 "--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                 "--megatron-args", f"@{args}"]) == 0
    assert ("tracemem's flags set what the Megatron-LM job leaves to its default: "
            "--fine-grained-activation-offloading, --offload-modules") in capsys.readouterr().out
