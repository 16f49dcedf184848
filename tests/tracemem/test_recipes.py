"""tracemem.recipes: the deepseek-v3 recipe against arXiv 2412.19437 (sections cited), user
overrides, a bad name, and the EMA's host bytes by hand."""

import pytest

from tracemem.errors import TracememError
from tracemem.recipes import recipe_fields


def test_deepseek_v3_fields_are_the_papers():
    f = recipe_fields("deepseek-v3")
    assert f["world_size"] == 2048  # 3.1: 2048 H800 GPUs
    assert f["gpu"] == "H800" and f["hbm"] == "80GB"  # 3.1; H800 data sheet 80 GB
    assert f["pp"] == 16 and f["schedule"] == "dualpipe"  # 3.2, 3.2.1
    assert f["ep"] == 64 and f["tp"] == 1  # 3.2: EP 64 over 8 nodes; no TP
    assert f["zero"] == 1  # 3.2: ZeRO-1
    assert f["recompute"] == "selective"  # 3.2.3
    # 3.2.3 (RMSNorm, MLA up-projection); 3.3.3 (the SwiGLU's output recomputed)
    assert f["recompute_modules"] == ("layernorm", "mla_up_proj", "moe_act")
    assert f["kernel_options"]["fp8_recipe"] == "blockwise"  # 3.3: 1x128 / 128x128
    assert f["kernel_options"]["fp8_moe_act_cache"] is True  # 3.3.3: its input in FP8
    assert f["kernel_options"]["fp8_dispatch"] is True  # 3.3.3: FP8 dispatch, BF16 combine
    assert f["kernel_options"]["e5m6_attention_output"] is True  # 3.3.3: E5M6
    assert f["precision"] == "deepseek-v3"  # 3.3.3: bf16 moments, fp32 master + grads
    assert f["seq_length"] == 4096 and f["global_batch_size"] == 15360  # 4.2
    assert f["ema"] == "host"  # 3.2.3: EMA in CPU


def test_bad_recipe_name_is_one_line():
    with pytest.raises(TracememError, match="--recipe 'nope' is unknown; choose one of"):
        recipe_fields("nope")


def test_ema_host_bytes_by_hand():
    import torch

    from tracemem.offload import ema_host_bytes

    model = torch.nn.Linear(3, 5, device="meta")  # 3*5 + 5 = 20 elements, fp32: 80 B
    assert ema_host_bytes(model) == 80


def test_deepseek_v3_mtp_sharing_is_honoured_not_approximated():
    # 2.2 / 3.2.3: MTP shares the embedding and head; under DualPipe both sit on the rank that
    # holds the MTP module, which builds one of each (tests/modeling/test_mtp_sharing.py)
    from tracemem.recipes import RECIPES

    recipe = RECIPES["deepseek-v3"]
    assert not [a for a in recipe.approximations if "MTP" in a]
    assert recipe.approximations == ()  # every element of 3.3's FP8 scheme is traced
    assert "MTP shares them" in recipe.sources["schedule"]


def test_the_nearest_megatron_job_file_is_the_recipe_but_what_megatron_cannot_run():
    # docs/examples/deepseek-v3-megatron.args: the recipe as Megatron-LM arguments, except
    # what Megatron-LM has no argument for (docs/examples/deepseek-v3-as-trained.md)
    from pathlib import Path

    from tracemem.frontdoors.megatron import megatron_job
    from tracemem.recipes import recipe_job

    path = Path(__file__).parents[2] / "docs" / "examples" / "deepseek-v3-megatron.args"
    argv = path.read_text().replace("\\\n", " ").split()
    job = megatron_job(argv, world_size=2048, gpu="H800", hbm="80GB")
    recipe = recipe_job("deepseek-v3")
    for name in ("world_size", "tp", "pp", "ep", "etp", "zero", "recompute",
                 "recompute_modules", "seq_length", "global_batch_size", "micro_batch_size",
                 "pp_layout", "microbatches"):
        assert getattr(job, name) == getattr(recipe, name), name
    assert job.config.num_layers == recipe.config.num_layers == 61
    assert job.profile.fp8_recipe == recipe.profile.fp8_recipe == "blockwise"
    # what differs: DualPipe (Megatron-LM has 1F1B here), the EMA, DeepSeek's FP8 deltas,
    # the fp32 master kept as bf16 + int16 remainders, Megatron's native cross entropy
    assert (job.schedule, recipe.schedule) == ("1f1b", "dualpipe")
    assert recipe.ema == "host" and job.ema in (None, "none")
    assert not any(job.profile.options.get(o) for o in
                   ("fp8_moe_act_cache", "fp8_dispatch", "e5m6_attention_output"))
    assert job.parallel.precision_spec.store_param_remainders
    assert not recipe.parallel.precision_spec.store_param_remainders


def test_overrides_turn_off_the_recipes_deepseek_options_that_need_what_they_replace():
    # fp8_dispatch and e5m6_attention_output need blockwise FP8, fp8_moe_act_cache moe_act
    # recompute; they have no flags, so an override that takes what they need turns them off
    # (Job.recipe_off says which and why) instead of being refused
    from tracemem.recipes import recipe_job

    job = recipe_job("deepseek-v3", kernel_options={"fp8_recipe": "tensorwise"})
    assert job.recipe_off == ("fp8_dispatch: it needs --fp8-recipe blockwise",
                              "e5m6_attention_output: it needs --fp8-recipe blockwise")
    assert not job.profile.options["fp8_dispatch"]
    assert job.profile.options["fp8_moe_act_cache"]  # tensorwise is FP8: still applies
    job = recipe_job("deepseek-v3", recompute="none")
    assert job.recipe_off == ("fp8_moe_act_cache: it needs FP8 and --recompute selective with "
                              "moe_act",)
    assert recipe_job("deepseek-v3").recipe_off == ()


def test_a_recipe_is_applied_by_recipe_job_only():
    from tracemem.job import Job
    from tracemem.recipes import recipe_job

    with pytest.raises(TracememError) as error:
        Job.create("deepseek-tiny", world_size=8, ep=8, micro_batch_size=1, seq_length=64,
                   num_microbatches=1, recipe="deepseek-v3")
    assert str(error.value) == ("Job(recipe='deepseek-v3') only records a recipe; apply one "
                                "with tracemem.recipes.recipe_job(name, **overrides) (recipes: "
                                "deepseek-v3)")
    with pytest.raises(TracememError, match=r"recipe_job\('deepseek-v3', recipe=\.\.\.\): the "
                                            r"recipe is the first argument"):
        recipe_job("deepseek-v3", recipe="x")


def test_what_fits_takes_the_recipes_hbm(monkeypatch):
    # --recipe deepseek-v3 sets --hbm 80GB; --what-fits used to ask for --hbm before the
    # recipe was applied. The estimate is stopped at once: only the check is under test
    import tracemem.estimator
    from tracemem.cli import main

    class Reached(Exception):
        pass

    def stop(*args, **kwargs):
        raise Reached
    monkeypatch.setattr(tracemem.estimator, "estimate", stop)
    with pytest.raises(Reached):
        main(["estimate", "--recipe", "deepseek-v3", "--what-fits", "--quiet"])


def test_an_option_turned_off_takes_its_assumption_with_it():
    # the note lists the assumption of a DeepSeek option's element only while it is on
    import argparse

    from tracemem.cli import _override_note
    from tracemem.recipes import RECIPES, recipe_job

    texts = RECIPES["deepseek-v3"].option_assumptions
    on = _override_note(argparse.Namespace(job=recipe_job("deepseek-v3")))
    assert all(text in on for text in texts.values())
    off = _override_note(argparse.Namespace(job=recipe_job("deepseek-v3", ep=1,
                                                            recompute="none")))
    assert texts["fp8_dispatch"] not in off and texts["fp8_moe_act_cache"] not in off
    assert texts["e5m6_attention_output"] in off


def test_an_fp8_flag_over_the_recipe_replaces_only_what_it_names(monkeypatch):
    # --fp8-format hybrid alone used to bring Megatron's default --fp8-recipe delayed along,
    # replacing the recipe's blockwise; only the typed flag replaces the recipe's value
    import tracemem.estimator
    from tracemem.cli import main

    seen = []

    def stop(job, *args, **kwargs):
        seen.append(job)
        raise KeyboardInterrupt
    monkeypatch.setattr(tracemem.estimator, "estimate", stop)
    # the CLI ends an interrupt with one line and exit code 130
    assert main(["estimate", "--recipe", "deepseek-v3", "--fp8-format", "hybrid",
                 "--quiet"]) == 130
    options = seen[0].profile.options
    assert (options["fp8_format"], options["fp8_recipe"]) == ("hybrid", "blockwise")
    assert options["fp8_dispatch"] and seen[0].recipe_off == ()
