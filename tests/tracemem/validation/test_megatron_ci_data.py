"""The Megatron-LM CI memory data and its loader (tracemem/validation/megatron_ci.py).

Reference: NVIDIA/Megatron-LM itself, read by hand with ``git show`` on a clone at d98e8a6
(2026-08-22). The literals below are the golden files' values as committed there, e.g.

    git show d98e8a6:tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2_resume_torch_dist/golden_values_dev_dgx_h100.json
    -> "mem-max-allocated-bytes": {"start_step": 1, "end_step": 100, "step_interval": 1,
       "values": {"1": 1245477376.0, "2": 1427384832.0, ...}}
    git log --follow -- <that file>: 93ebf8d72f (2026-08-19), 5fe3f06658 (2026-05-07, the
    same memory values), 4e85d74ae9 (2026-04-14: "1": 1246525952.0, "2": 1426598400.0)
    git show 5fe3f06658:tests/test_utils/recipes/h100/gpt.yaml -> spec nodes: 1, gpus: 8;
    products: gpt3_mcore_te_tp2_pp2_resume_torch_dist, environment [dev], platforms [dgx_h100]

No estimate runs here (the board's own command does that).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tracemem.errors import TracememError
from tracemem.validation import megatron_ci
from tracemem.validation.megatron_ci import (DATA, SCORED_PLATFORMS, CICase, case_job_kwargs,
                                              load_cases, load_index, model_args_argv,
                                              selection)

HEAD = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
SHA = re.compile(r"^[0-9a-f]{40}$")


def _case(name: str) -> CICase:
    found = [case for case in load_cases() if case.name == name]
    assert len(found) == 1, name
    return found[0]


def test_a_dense_h100_case_read_by_hand():
    case = _case("gpt3_mcore_te_tp2_pp2_resume_torch_dist@dev_dgx_h100")
    assert case.directory == "tests/functional_tests/test_cases/gpt/" \
                             "gpt3_mcore_te_tp2_pp2_resume_torch_dist"
    assert (case.model, case.environment, case.platform, case.gpu, case.run) == \
        ("gpt", "dev", "dgx_h100", "H100", 1)
    assert case.test_type == "ckpt-resume"
    assert case.source_commit == HEAD
    # the newest commit (93ebf8d72f) only dropped NaN iteration times; 5fe3f06658 is the
    # oldest with these memory values (4e85d74ae9's differ)
    assert case.pairing_commit == "5fe3f06658b393283eafc32f039c3d0c2468a69f"
    assert (case.nodes, case.gpus_per_node, case.world_size) == (1, 8, 8)
    assert case.recipes == ("tests/test_utils/recipes/h100/gpt.yaml",)
    assert case.training_script == "pretrain_gpt.py"
    assert case.measured_iteration == 2
    assert case.measured_bytes == 1427384832
    assert case.iteration1_bytes == 1245477376
    assert case.allocated[2] == 517243392  # mem-allocated-bytes, iteration 2
    assert (case.logged_iterations, case.last_iteration) == (100, 100)
    # model_config.yaml at 5fe3f06658
    assert case.model_args["--tensor-model-parallel-size"] == "2"
    assert case.model_args["--pipeline-model-parallel-size"] == "2"
    assert case.model_args["--micro-batch-size"] == "4"
    assert case.model_args["--global-batch-size"] == "32"
    assert case.model_args["--seq-length"] == "1024"
    assert case.vocab_size == 50257  # the GPT-2 BPE vocab.json it reads
    # megatron/core/package_info.py 0.18.0 and docker/.ngc_version.dev at 5fe3f06658
    assert case.megatron_core == "0.18.0"
    assert case.container == "nvcr.io/nvidia/pytorch:26.04-py3"


def test_a_moe_gb200_case_is_two_nodes_of_four():
    # git show 64bee49c96:tests/test_utils/recipes/gb200/moe.yaml -> nodes: 2, gpus: 4;
    # golden_values_dev_dgx_gb200.json there and at d98e8a6: "1": 1878177280.0,
    # "2": 2110116864.0, "50": 2111965696.0 (b2a8ec7458's are 512 B higher)
    case = _case("gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel@dev_dgx_gb200")
    assert case.pairing_commit == "64bee49c96897b491335b4fd3b9d875ec104ec70"
    assert (case.nodes, case.gpus_per_node, case.world_size) == (2, 4, 8)
    assert (case.iteration1_bytes, case.measured_bytes) == (1878177280, 2110116864)
    assert case.max_allocated[50] == 2111965696
    assert case.model_args["--expert-model-parallel-size"] == "2"


def test_every_fifth_iteration_scores_iteration_5():
    # golden_values_dev_dgx_h100.json: step_interval 5, "1": 2359490560.0, "5": 2643299328.0;
    # paired at 194b2be238, when the case was gpt3_mr_mcore_te_tp1_pp4_vp1_resume_torch_dist_
    # dgx_a100_1N8G (tests/test_utils/recipes/gpt.yaml, 1 node of 8)
    case = _case("gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist@dev_dgx_h100")
    assert case.pairing_commit == "194b2be238ca06a13b12292e6d88ed480e0c9172"
    assert "gpt3_mr_mcore_te_tp1_pp4_vp1_resume_torch_dist_dgx_a100_1N8G" in case.pairing_path
    assert (case.measured_iteration, case.measured_bytes) == (5, 2643299328)
    assert case.iteration1_bytes == 2359490560
    assert case.world_size == 8


def test_every_case_has_a_source_commit_and_a_pairing_commit():
    cases = load_cases()
    assert len(cases) == len({case.name for case in cases})
    for case in cases:
        assert case.source_commit == HEAD
        assert SHA.match(case.pairing_commit), case.name
        assert case.pairing_path.startswith("tests/functional_tests/test_cases/"), case.name
        assert case.model_config_path.endswith("/model_config.yaml"), case.name
        assert case.directory == f"tests/functional_tests/test_cases/{case.model}/{case.case}"
        assert case.megatron_core, case.name
        if case.world_size is None:
            assert case.world_size_reason, case.name
        else:
            assert case.world_size == case.nodes * case.gpus_per_node, case.name


def test_bytes_are_ints_and_a_peak_never_falls_within_one_process():
    # nothing in megatron/ resets the peak: within one process the series never decreases.
    # Release tests run over several SLURM windows, each a new process (run_ci_test.sh), so
    # only they may fall.
    for case in load_cases():
        steps = sorted(case.max_allocated)
        assert all(isinstance(v, int) and v > 0 for v in case.max_allocated.values())
        if case.test_type != "release":
            values = [case.max_allocated[s] for s in steps]
            assert values == sorted(values), case.name
        if case.measured_bytes is not None:
            assert case.measured_iteration == min(s for s in steps if s > 1)
            assert case.max_allocated[case.measured_iteration] == case.measured_bytes


def test_the_index_covers_every_json_and_every_case_directory():
    index = load_index()
    assert index["source"]["commit"] == HEAD
    listed = {entry["file"] for entry in index["cases"] if entry["file"]}
    on_disk = {path.name for path in DATA.glob("*.json")} - {"index.json"}
    assert listed == on_disk
    assert len({entry["directory"] for entry in index["cases"]}) == len(index["cases"]) \
        == index["counts"]["case_directories"]
    for entry in index["cases"]:
        assert entry["training"] in (True, False)
        if entry["file"]:
            assert entry["training"] and entry["memory_series"], entry["case"]
        else:
            assert entry["reason"], entry["case"]
    assert {case.case for case in load_cases()} == {entry["case"] for entry in index["cases"]
                                                     if entry["file"]}


def test_each_case_file_names_its_source():
    for path in sorted(DATA.glob("*.json")):
        if path.name == "index.json":
            continue
        data = json.loads(path.read_text())
        assert path.name == f"{data['case']}.json"
        assert data["source"] == {"repository": "https://github.com/NVIDIA/Megatron-LM",
                                  "commit": HEAD}
        for golden in data["golden"]:
            assert golden["model_config"] in data["model_configs"], (path.name,
                                                                     golden["file"])


def test_argv_is_what_the_front_door_reads_from_the_same_yaml(tmp_path):
    from tracemem.frontdoors import megatron_args_from_yaml

    def rules(case):  # which of the runner's rules its MODEL_ARGS use
        kinds = set()
        for value in case.model_args.values():
            text = str(value).strip()
            kinds.add("list" if isinstance(value, list) else "bool" if isinstance(value, bool)
                      else "empty" if text == "" else "brackets" if text.startswith("[")
                      else "spaces" if " " in text else "plain")
        return frozenset(kinds)

    # one model_config per model folder and per mix of rules (PyYAML reads ~60 ms a file)
    seen = set()
    for case in load_cases():
        key = (case.model, rules(case))
        if key in seen:
            continue
        seen.add(key)
        path = tmp_path / "model_config.yaml"  # JSON is YAML: strings stay strings
        path.write_text(json.dumps({"MODEL_ARGS": dict(case.model_args),
                                    "ENV_VARS": dict(case.env_vars)}))
        argv, env = megatron_args_from_yaml(path)
        # the front door reads a file as today's runner does; a case as its pairing commit's
        assert argv == model_args_argv(case.model_args), case.name
        assert env == dict(case.env_vars), case.name


def test_a_case_is_read_by_the_runner_of_its_pairing_commit():
    # _run_training.sh before 7418b1b8fb (2026-02-26): xargs, then eval unquoted, so the YAML
    # plain scalar's two backslashes before | ( ) are both taken; from it on, a value with |
    # ( ) is double-quoted and the files say Et*3|(tt|)*6tmL (d98e8a6's model_config.yaml)
    from tracemem.validation.megatron_ci import runner_quotes_metacharacters

    (case,) = [c for c in load_cases() if c.name ==
               "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading@dev_dgx_gb200"]
    assert case.pairing_date == "2026-01-30T09:46:07+00:00"
    assert not runner_quotes_metacharacters(case.pairing_date)
    assert runner_quotes_metacharacters("2026-02-26T23:56:45+00:00")
    assert not runner_quotes_metacharacters("2026-02-26T23:56:44+00:00")
    layout = case.argv[case.argv.index("--pipeline-model-parallel-layout") + 1]
    assert case.model_args["--pipeline-model-parallel-layout"] == r"Et*3\\|\\(tt\\|\\)*6mL"
    assert layout == "Et*3|(tt|)*6mL"


def test_an_inferred_launch_and_layout_are_marked_with_their_evidence():
    from tracemem.validation.megatron_ci import INFERENCES

    name = "gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental@dev_dgx_h100"
    (case,) = [c for c in load_cases() if c.name == name]
    assert (case.world_size, case.nodes, case.gpus_per_node) == (8, 1, 8)
    assert case.world_size_reason is None and case.inferred == INFERENCES[name].why
    assert "08abeedbfe" in case.inferred and "get_mtp_num_layers_to_build" in case.inferred
    layout = case.argv[case.argv.index("--pipeline-model-parallel-layout") + 1]
    assert layout == "Et*3|(tt|)*6tmL"
    # every other case: nothing inferred
    assert [c.name for c in load_cases() if c.inferred] == [name]


def test_model_args_argv_follows_the_test_runner():
    assert model_args_argv({"--bf16": True, "--fp16": False, "--load": "", "--num-layers": "12",
                            "--cp-comm-type": "[p2p a2a]", "--lr": "1e-4",
                            "--pipeline-model-parallel-layout": "Et*2|(tt|)*5t|tmL"}) == \
        ["--bf16", "--num-layers", "12", "--cp-comm-type", "p2p", "a2a", "--lr", "1e-4",
         "--pipeline-model-parallel-layout", "Et*2|(tt|)*5t|tmL"]
    # xargs takes quotes and one backslash; the eval of an unquoted word another level; a
    # value in (...), with a space or (today's runner) with | ( ) is double-quoted there
    from tracemem.frontdoors.megatron_args import run_training_words

    old = {"quote_metacharacters": False}
    assert run_training_words("--x", r"Et*3\\|\\(tt\\|\\)*6tL", **old) == ["Et*3|(tt|)*6tL"]
    assert run_training_words("--x", r"Et*3\\|\\(tt\\|\\)*6tL") == [r"Et*3\|\(tt\|\)*6tL"]
    assert run_training_words("--x", r'\"*E\"') == ["*E"]
    assert run_training_words("--x", "([0]*3+[1]*13)", **old) == ["([0]*3+[1]*13)"]
    assert run_training_words("--x", "a  b") == ["a b"]  # xargs' items, echo's one space
    assert run_training_words("--x", "'a  b'") == ["a  b"]  # one item: quoted blanks kept
    assert run_training_words("--x", "[p2p  a2a]") == ["p2p", "a2a"]
    assert run_training_words("--x", "  12 ") == ["12"]
    with pytest.raises(TracememError, match=r"MODEL_ARGS --x: unmatched double quote"):
        run_training_words("--x", 'a"b')


def test_the_containers_pytorch_cublas_default():
    # NGC PyTorch up to 26.02: a torch before pytorch/pytorch#175344; 26.04 on: after it
    assert megatron_ci.torch_cublas_default("nvcr.io/nvidia/pytorch:25.11-py3") == "sm90"
    assert megatron_ci.torch_cublas_default("nvcr.io/nvidia/pytorch:26.02-py3") == "sm90"
    assert megatron_ci.torch_cublas_default("nvcr.io/nvidia/pytorch:26.04-py3") == "2.13"
    assert megatron_ci.torch_cublas_default("nvcr.io/nvidia/pytorch:26.06-py3") == "2.13"
    assert megatron_ci.torch_cublas_default(None) == "2.13"
    assert megatron_ci.torch_cublas_default("my/image:latest") == "2.13"
    gb200 = _case("gpt3_mcore_te_tp2_pp2_resume_torch_dist_cp2_nondeterministic@dev_dgx_gb200")
    kwargs = case_job_kwargs(gb200)
    assert (kwargs["gpu"], kwargs["torch_cublas_default"]) == ("GB200", "sm90")
    assert kwargs["cublas_workspace_config"] is None


def test_the_evidence_for_the_26_02_line_in_the_golden_files():
    # git show 4e85d74ae9:.../gpt3_mcore_te_tp2_pp2_resume_torch_dist_cp2_nondeterministic/
    # golden_values_dev_dgx_{h100,gb200}.json: the same commit, container 26.02 and arguments
    # (no CUBLAS_WORKSPACE_CONFIG), "mem-allocated-bytes" at iteration 2: 511214080.0 on H100,
    # 461144576.0 on GB200: two PyTorch workspaces of 32 MiB against two of 8,519,680 B
    name = "gpt3_mcore_te_tp2_pp2_resume_torch_dist_cp2_nondeterministic@dev_dgx_"
    h100, gb200 = _case(name + "h100"), _case(name + "gb200")
    assert h100.container == gb200.container == "nvcr.io/nvidia/pytorch:26.02-py3"
    assert h100.allocated[2] == 511_214_080 and gb200.allocated[2] == 461_144_576
    assert h100.allocated[2] - gb200.allocated[2] == 2 * (33_554_432 - 8_519_680)


def test_a_case_without_a_world_size_is_refused_with_its_reason():
    unsized = [case for case in load_cases() if case.world_size is None]
    assert unsized
    with pytest.raises(TracememError, match="no world size: .+"):
        case_job_kwargs(unsized[0])


def test_selection_scores_dev_first_runs_h100_first_and_gives_every_other_a_reason():
    scored, left_out = selection()
    assert len(scored) + len(left_out) == len(load_cases())
    assert scored, "the front door accepts no case"
    assert all(case.scored_gpu and case.world_size for case in scored)
    order = [megatron_ci._GPU_ORDER[case.gpu] for case in scored]
    assert order == sorted(order)
    for case, reason in left_out:
        assert reason and "\n" not in reason, case.name
    reasons = {case.name: reason for case, reason in left_out}
    assert "lts" in reasons["gpt3_mcore_te_tp2_pp2_resume_torch_dist@lts_dgx_a100"]
    assert "second, resumed run" in \
        reasons["gpt3_mcore_te_tp2_pp2_resume_torch_dist@dev_dgx_h100_2nd"]
    assert {case.platform for case in scored} <= set(SCORED_PLATFORMS)


def test_loading_every_case_takes_well_under_a_second():
    megatron_ci._all_cases.cache_clear()
    megatron_ci.load_index.cache_clear()
    started = time.perf_counter()
    cases = load_cases()
    elapsed = time.perf_counter() - started
    assert len(cases) > 800
    assert elapsed < 1.0, f"{elapsed:.2f} s"
