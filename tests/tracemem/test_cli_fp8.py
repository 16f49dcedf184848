"""FP8 on tracemem's own flags (issue 24): Megatron-LM's FP8 flags, under its names and
choices, give the Job the Megatron-LM front door gives for the same arguments.

References: Megatron-LM d98e8a6 ``megatron/training/arguments.py`` (the flags, their choices
and defaults: ``--fp8-recipe`` delayed, ``--fp8-amax-history-len`` 1,
``--num-layers-at-start-in-bf16`` / ``--num-layers-at-end-in-bf16`` 1, read from its
argument data); the Megatron-LM front door (``tracemem.frontdoors.megatron_job``) on
deepseek-tiny written out as Megatron arguments below (what ``--print-megatron-args`` prints
for it, kept here as a launch script would) is the other side of every comparison.
"""

import shlex

import pytest

from tracemem.cli import build_parser, job_from_args, main
from tracemem.estimator import estimate
from tracemem.frontdoors import megatron_job
from tracemem.frontdoors.megatron_args import megatron_parser

# deepseek-tiny (modeling/families/deepseek/presets/deepseek-tiny.json) as Megatron-LM
# arguments: 4 layers (2 dense, 2 MoE of 8 experts, top-2), MLA, one MTP layer, b 1, s 64
MEGATRON = shlex.split("""
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --bf16 --num-layers 4
--mtp-num-layers 1 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128
--hidden-dropout 0 --attention-dropout 0 --norm-epsilon 1e-06 --disable-bias-linear
--normalization RMSNorm --qk-layernorm --multi-latent-attention
--moe-shared-expert-intermediate-size 32 --moe-ffn-hidden-size 32 --moe-router-topk 2
--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-grouped-gemm
--max-position-embeddings 4096 --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --num-experts 8 --moe-layer-freq '([0]*2+[1]*2)'
--q-lora-rank 48 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
--padded-vocab-size 256 --attention-backend fused --moe-shared-expert-overlap
--moe-router-dtype fp32 --moe-token-dispatcher-type alltoall --moe-permute-fusion
--micro-batch-size 1 --global-batch-size 4 --seq-length 64 --use-distributed-optimizer
""")
# the same job on tracemem's flags (Megatron's loss: the unfused cross entropy)
FLAGS = ["estimate", "--model", "deepseek-tiny", "--world-size", "2", "--micro-batch-size",
         "1", "--seq-length", "64", "--num-microbatches", "2", "--cross-entropy-fusion", "none",
         "--quiet"]
FP8_KEYS = {"fp8_recipe", "fp8_format", "fp8_param_gather", "fp8_amax_history_len",
            "fp8_layers_at_start_in_bf16", "fp8_layers_at_end_in_bf16"}

# FP8 arguments -> the kernel options they mean, written out from Megatron's semantics
# (fp8_utils.py get_fp8_recipe, is_first_last_bf16_layer; arguments.py defaults)
SETTINGS = {
    "--fp8-format hybrid --fp8-recipe tensorwise": dict(
        fp8_recipe="tensorwise", fp8_format="hybrid", fp8_param_gather=False,
        fp8_amax_history_len=1, fp8_layers_at_start_in_bf16=0, fp8_layers_at_end_in_bf16=0),
    "--fp8-format e4m3 --fp8-amax-history-len 16 --first-last-layers-bf16 "
    "--num-layers-at-end-in-bf16 2": dict(  # --fp8-recipe delayed and 1 layer at the start
        fp8_recipe="delayed", fp8_format="e4m3", fp8_param_gather=False,
        fp8_amax_history_len=16, fp8_layers_at_start_in_bf16=1, fp8_layers_at_end_in_bf16=2),
    "--fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather": dict(
        fp8_recipe="blockwise", fp8_format="e4m3", fp8_param_gather=True,
        fp8_amax_history_len=1, fp8_layers_at_start_in_bf16=0, fp8_layers_at_end_in_bf16=0),
}


def flags_job(argv):
    """The Job of a ``tracemem estimate`` command line, as main() builds it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = {action.dest for action in parser._subparsers._group_actions[0]
                  .choices["estimate"]._actions
                  for opt in action.option_strings if opt in argv}
    return job_from_args(args)


@pytest.mark.parametrize("fp8", sorted(SETTINGS))
def test_the_fp8_flags_give_the_job_the_megatron_front_door_gives(fp8):
    flags = flags_job(FLAGS + fp8.split())
    megatron = megatron_job(MEGATRON + fp8.split(), world_size=2)
    assert {k: v for k, v in flags.kernel_options.items() if k.startswith("fp8_")} == \
        SETTINGS[fp8]
    assert {k: v for k, v in megatron.kernel_options.items() if k in FP8_KEYS} == SETTINGS[fp8]
    assert dict(flags.profile.options) == dict(megatron.profile.options)  # fp8_arch sm90 too
    assert flags.profile.fp8_arch == "sm90"  # no --gpu: Hopper


def test_an_fp8_estimate_is_the_same_bytes_through_either_door():
    fp8 = "--fp8-format hybrid --fp8-recipe tensorwise".split()
    flags = estimate(flags_job(FLAGS + fp8 + ["--gpu", "H100"]))
    megatron = estimate(megatron_job(MEGATRON + fp8, world_size=2, gpu="H100"))
    bf16 = estimate(megatron_job(MEGATRON, world_size=2, gpu="H100"))
    assert [r.peak_bytes for r in flags.ranks] == [r.peak_bytes for r in megatron.ranks]
    assert [r.static.fp8_bytes for r in flags.ranks] == \
        [r.static.fp8_bytes for r in megatron.ranks]
    # the FP8 weight copies are there (none in bf16), and the saved inputs are FP8
    assert flags.ranks[0].static.fp8_bytes > 0
    assert bf16.ranks[0].static.fp8_bytes == 0
    assert flags.ranks[0].activation_bytes < bf16.ranks[0].activation_bytes


def test_the_fp8_flags_take_megatrons_names_choices_and_defaults():
    theirs = {opt: a for a in megatron_parser()._actions for opt in a.option_strings}
    sub = build_parser()._subparsers._group_actions[0].choices
    for command, group in (("estimate", "training step"), ("fit", "every layout's settings")):
        ours = {a.option_strings[0]: a for g in sub[command]._action_groups
                if g.title == group for a in g._group_actions}
        for flag in ("--fp8-format", "--fp8-recipe", "--fp8-param-gather",
                     "--fp8-amax-history-len", "--first-last-layers-bf16",
                     "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
            mine, megatron = ours[flag], theirs[flag]
            assert (mine.dest, mine.choices, mine.default, mine.type) == \
                (megatron.dest, megatron.choices, megatron.default, megatron.type), flag
    assert theirs["--fp8-format"].choices == ["e4m3", "hybrid"]
    assert theirs["--fp8-recipe"].choices == ["tensorwise", "delayed", "mxfp8", "blockwise",
                                              "custom"]


def test_typed_fp8_flags_beside_a_megatron_job_override_it_and_say_so(capsys, tmp_path):
    path = tmp_path / "job.args"
    path.write_text(shlex.join(MEGATRON + ["--fp8-format", "hybrid"]) + "\n")
    code = main(["estimate", "--world-size", "2", "--quiet", "--fp8-recipe", "tensorwise",
                 "--print-megatron-args", "--megatron-args", f"@{path}"])
    out = capsys.readouterr()
    assert code == 0
    # the job gives no --fp8-recipe: Megatron's default (delayed) is what the flag replaces
    assert out.err.splitlines()[0] == ("tracemem's flags set what the Megatron-LM job leaves "
                                       "to its default: --fp8-recipe")
    assert out.out.rstrip().endswith("--fp8-format hybrid \\\n--fp8-recipe tensorwise")
    job = megatron_job(MEGATRON + "--fp8-format hybrid --fp8-recipe tensorwise".split(),
                       world_size=2)
    printed = shlex.split(out.out.replace("\\\n", " "))
    assert megatron_job(printed, world_size=2).kernel_options == job.kernel_options


@pytest.mark.parametrize("extra, message", [
    ("--fp8-recipe tensorwise",
     "--fp8-recipe applies with --fp8-format (e4m3 or hybrid); give it too (Megatron-LM runs "
     "FP8 only with --fp8-format)"),
    ("--fp8-format hybrid --kernels torch",  # the Job's words, as through the Megatron door
     "FP8 (--fp8-format hybrid) needs --kernels megatron-te (Transformer Engine's FP8 "
     "modules); --kernels torch runs bf16"),
    ("--fp8-format hybrid --gpu A100",  # issue 26: the recipe not given is Megatron's default
     "FP8 (--fp8-recipe delayed (Megatron's default)) needs compute capability 8.9 or higher, "
     "as every FP8 recipe does (TE check_fp8_support: Ada, Hopper and later); the GPU has "
     "8.0: train in bf16 (no --fp8-format)"),
    ("--fp8-format hybrid --fp8-recipe custom",
     "--fp8-recipe custom is not modelled yet (a user quantizer factory's tensors); use "
     "delayed, tensorwise, mxfp8 or blockwise"),
    ("--fp8-format hybrid --fp8-recipe mxfp8 --gpu H100",
     "--fp8-recipe mxfp8 runs on Blackwell only (TE _compute_mxfp8_support: compute "
     "capability 10.x / 11.x); this job's GPU is 9.0"),
    ("--fp8-format hybrid --fp8-param-gather --zero 0",
     "Megatron-LM refuses this job: --fp8-param-gather only supported with distributed "
     "optimizer, torch fsdp2, megatron fsdp, or inference mode (Megatron-LM d98e8a6 "
     "validate_args)"),
])
def test_fp8_errors_are_one_line_and_exit_2(capsys, extra, message):
    plain = [a for a in FLAGS if a not in ("--cross-entropy-fusion", "none")]  # a TE option
    assert main(plain + extra.split()) == 2
    assert capsys.readouterr().err == f"tracemem: error: {message}\n"


def test_an_fp8_format_megatron_does_not_offer_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(FLAGS + ["--fp8-format", "e5m2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --fp8-format: invalid choice: 'e5m2'" in err
    assert len(err.strip().splitlines()) == 1


def test_the_same_errors_through_the_megatron_door(capsys, tmp_path):
    path = tmp_path / "job.args"
    path.write_text(shlex.join(MEGATRON) + "\n")
    assert main(["estimate", "--world-size", "2", "--quiet", "--kernels", "torch",
                 "--fp8-format", "hybrid", "--megatron-args", f"@{path}"]) == 2
    assert capsys.readouterr().err == (
        "tracemem: error: FP8 (--fp8-format hybrid) needs --kernels megatron-te "
        "(Transformer Engine's FP8 modules); --kernels torch runs bf16\n")
    assert main(["estimate", "--world-size", "2", "--quiet", "--fp8-recipe", "tensorwise",
                 "--megatron-args", f"@{path}"]) == 2
    assert capsys.readouterr().err == ("tracemem: error: --fp8-recipe applies with "
                                       "--fp8-format (e4m3 or hybrid); give it too (Megatron-LM "
                                       "runs FP8 only with --fp8-format)\n")


def test_fit_takes_the_fp8_flags_for_every_layout(monkeypatch):
    import tracemem.fit

    seen = {}

    def record(model, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(tracemem.fit, "fit", record)
    with pytest.raises(SystemExit):
        main(["fit", "--model", "deepseek-tiny", "--world-size", "2", "--hbm", "80GiB",
              "--seq-length", "64", "--global-batch-size", "4", "--quiet", "--fp8-format",
              "hybrid", "--fp8-recipe", "tensorwise"])
    assert seen["kernel_options"] == SETTINGS["--fp8-format hybrid --fp8-recipe tensorwise"]
