"""Megatron-LM's functional tests as measured memory: the cases of the megatron-ci scoreboard.

The data (``tracemem/validation/megatron_ci/<case>.json``, one per training test case whose
golden values hold a memory series, and ``index.json`` for every test case directory) was read
from NVIDIA/Megatron-LM by ``tracemem/validation/megatron_ci/collect.py``; its README says how
to make it again. This module only reads it: ``load_cases`` (one ``CICase`` per golden file),
``case_job_kwargs`` (a case's ``tracemem.job.Job`` keywords through the Megatron-LM front door)
and ``selection`` (the cases tracemem can express, and every other one with what stops it).

What the numbers are, read at NVIDIA/Megatron-LM d98e8a6 (2026-08-22; the files the data
comes from are older commits, each case's own, see "Pairing" below):

- **Which rank.** megatron/training/global_vars.py ``_set_tensorboard_writer`` makes the
  TensorBoard writer only where ``args.rank == (args.world_size - 1)``, and
  megatron/training/training.py ``training_log`` writes the memory scalars only through that
  writer. So every series is global rank ``world_size - 1``: the last pipeline stage (output
  layer, loss, MTP, the last virtual chunks) and, whatever the rank order (``--use-tp-pp-dp-
  mapping``, the ``*_dp_last`` cases), the last rank of every TP / CP / DP / EP group, since
  the highest global rank has the highest coordinate in each.
- **What.** ``training_log``, under ``--log-memory-to-tensorboard``, reads
  ``torch.cuda.memory_stats()`` and writes ``"mem-allocated-bytes"`` =
  ``allocated_bytes.all.current`` and ``"mem-max-allocated-bytes"`` =
  ``allocated_bytes.all.peak`` (and mem-reserved-bytes, mem-allocated-count, which the golden
  values do not keep). Nothing in megatron/ calls ``torch.cuda.reset_peak_memory_stats``: the
  peak is the process's since it started, so the series never decreases within a run.
- **When.** ``train`` runs ``train_step`` (``optimizer.step()`` is inside it), then
  ``iteration += 1``, then ``training_log(..., iteration, ...)``, which writes when
  ``iteration % args.tensorboard_log_interval == 0`` (default 1,
  megatron/training/config/training_config.py). So the value at iteration n covers n whole
  steps, optimizer steps included, and what runs after the step before the log (the params
  norm of ``--log-params-norm``, ``calc_params_l2_norm``). Adam's moments are made by the
  inner optimizer's first ``step()``, lazily (Megatron's ``init_state_fn``,
  megatron/core/optimizer/__init__.py, makes them ahead only to load a checkpoint:
  optimizer.py ``sharded_state_dict(is_loading=True)``): iteration 1 holds their creation,
  iteration 2 is the first step with them present from the start. ``measured_bytes`` is
  iteration 2, or the first logged iteration after 1; ``iteration1_bytes`` is iteration 1, a
  second, separate check.
- **The golden files.** tests/functional_tests/python_test_utils/
  get_test_results_from_tensorboard_logs.py ``collect_train_test_metrics`` keeps
  "mem-allocated-bytes" and "mem-max-allocated-bytes" (besides losses, num-zeros,
  iteration-time) from ``common.read_tb_logs_as_list``, as ``GoldenValueMetric``:
  ``{"mem-max-allocated-bytes": {"start_step": 1, "end_step": 50, "step_interval": 1,
  "values": {"1": 2137625088.0, "2": ...}}}``. Each value is ``round(x.value, 5)`` of a
  TensorBoard scalar, which is float32: the byte count is the nearest float32 (a multiple of
  128 B between 1 and 2 GiB, 256 B between 2 and 4 GiB; relative error under 2**-24), kept here
  as an ``int``. run_ci_test.sh reads regular tests with ``--step-size 1`` (every iteration)
  and release tests with the default 5 (iterations 1, 5, 10, ...). A checkpoint-resume test's
  golden file is its first run; ``*_2nd.json`` is the second run, resumed from the
  checkpoint of iteration train_iters / 2 (``run == 2`` here).
- **File names.** The recipes (tests/test_utils/recipes/{h100,gb200}/*.yaml) run
  ``GOLDEN_VALUES_PATH=.../golden_values_{environment}_{platforms}.json``: environment ``dev``
  (the mcore_ci_dev image, docker/Dockerfile.ci.dev) or ``lts`` (docker/Dockerfile.ci.lts),
  platforms ``dgx_h100``, ``dgx_a100``, ``dgx_gb200``. ``dgxa100_dracooci`` and
  ``dgxa100_dracooci-ord`` are A100 clusters, ``dgxh100_dgxc`` an H100 one
  (tests/test_utils/python_scripts/recipe_parser.py ``resolve_cluster_config``,
  launch_nemo_run_workload.py); no recipe names them, so their GPU count is the same test
  case's recipe row of that environment and GPU kind. ``golden_values_dev.json`` /
  ``golden_values_lts.json`` (no platform) are named by no recipe at their pairing commit.
- **GPUs.** A recipe's ``spec`` ``nodes`` x ``gpus`` (GPUs per node: 8 on DGX A100 / H100,
  4 on GB200), which a ``products`` row may override (recipe_parser.py ``flatten_products``,
  ``flatten_workload``); _run_training.sh launches ``torchrun --nproc_per_node
  $GPUS_PER_NODE --nnodes $NUM_NODES``. The JET launcher that turns the recipe into those
  variables is not public. A test case no recipe lists (the release tests) has no world size,
  unless ``INFERENCES`` reads it from the case's history (a recipe row commented out at the
  pairing commit, listed at an earlier one with the same ``model_config.yaml``), with the
  evidence; the board marks such a case.
- **Pairing.** Each golden file is paired with the oldest commit, walking ``git log
  --follow`` back from d98e8a6, of the unbroken run whose ``mem-max-allocated-bytes`` and
  ``mem-allocated-bytes`` are the same numbers, iteration by iteration, as the newest
  version's; its ``model_config.yaml`` (MODEL_ARGS, ENV_VARS), recipes and versions are that
  commit's (megatron/core/package_info.py; docker/.ngc_version.<env>, else
  .gitlab/stages/01.build.yml's BASE_IMAGE; uv.lock's transformer-engine, or the lts
  Dockerfile's pin: each recorded with the file it came from, or None).
- **Arguments.** _run_training.sh turns MODEL_ARGS into the command line with ``yq``:
  ``true`` is the bare flag, a ``[...]`` value several values, any other value what
  ``echo "$value" | xargs`` and the runner's ``eval`` make of it (one level of quotes and
  backslashes each; a value with a space, and from 7418b1b8fb on one with ``|``, ``(`` or
  ``)``, is double-quoted in the eval). ``model_args_argv`` does the same, with the runner of
  the case's pairing commit (``runner_quotes_metacharacters``), as
  ``tracemem.frontdoors.megatron_args_from_yaml`` does for a file with today's.
  ``${DATA_PATH}`` and the other placeholders stay as written (paths).
- **PyTorch in the container.** Where ``CUBLAS_WORKSPACE_CONFIG`` is unset, PyTorch sizes its
  cuBLAS workspaces by its own default (``tracemem.workspaces.torch_cublas_workspace_bytes``),
  and on Blackwell that default changed with pytorch/pytorch#175344 (merged 2026-02-19):
  32 MiB since, 8,519,680 B before (``sm90 = major == 9 && minor == 0``). ``torch_cublas_
  default`` reads the case's container: NGC PyTorch up to 26.02 runs a torch before it ("sm90"),
  26.04 and later one after it ("2.13"). The evidence for the line between 26.02 and 26.04:
  Megatron-LM 5fe3f06658 (PR #4611, "Update Docker image version to 26.04-py3", 2026-05-07)
  refreshed 80 golden files; every GB200 run there without ``CUBLAS_WORKSPACE_CONFIG`` rose by
  49.3 to 50.7 MB after the step (``deepseek_proxy_fsdp_ep2_fsdp2_1node``: 50,069,504 B,
  exactly 2 x (33,554,432 - 8,519,680), two workspaces growing), while the runs that set
  ``:4096:8`` (32 MiB whatever the torch) and every H100 run moved by 2.1 MB or less; and
  Megatron-LM prepared its 26.02 dependencies by 2026-01-14 (82049aa847, "26.02 dependency
  bump main"), before the pull request. The NGC release notes for 26.02 and 26.04 (which
  would name the torch commits) are not read here. A100 and Hopper take the same bytes under
  both rules.
- **Vocabulary.** Most cases read the GPT-2 BPE vocabulary from a file (``--vocab-file
  .../bpe/vocab.json``), which Megatron's ``GPT2BPETokenizer`` (Hugging Face "gpt2") sizes at
  50,257 (collect.py ``GPT2_VOCAB`` cites the sources); ``case_job_kwargs`` passes that as
  ``vocab_size``. Other tokenizer files (SentencePiece, WordPiece, Hugging Face models) are not
  in the repository; such a case's vocabulary is None and the front door says so.

Example::

    from tracemem.validation.megatron_ci import load_cases, selection
    cases = load_cases()
    scored, left_out = selection()
    case = scored[0]
    case.name, case.world_size, case.measured_bytes   # bytes at iteration 2 on the last rank
"""

from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from tracemem.errors import TracememError

__all__ = ["CICase", "load_cases", "load_index", "case_job_kwargs", "selection",
           "model_args_argv", "DATA", "SCORED_PLATFORMS", "Inference", "INFERENCES",
           "torch_cublas_default"]

DATA = Path(__file__).with_name("megatron_ci")
# the platforms the board scores, in its order: H100 first, then A100 and GB200 as their own
# rows (the recipes' platforms; the cluster copies are left out)
SCORED_PLATFORMS = ("dgx_h100", "dgx_a100", "dgx_gb200")
_GPU_ORDER = {"H100": 0, "A100": 1, "GB200": 2}


@dataclass(frozen=True)
class CICase:
    """One golden file of one Megatron-LM functional test case, with its pairing commit's
    configuration and launch, and the memory it measured on global rank ``world_size - 1``.

    Bytes are ``int``; iterations are Megatron's (1 = after the first optimizer step). The
    mappings are read-only and left out of equality and hashing (``name`` identifies a case).
    """

    name: str  # "<case>@<golden file stem without golden_values_>", e.g. "...@dev_dgx_h100"
    case: str  # the test case directory's name
    model: str  # its model folder: gpt, moe, bert, t5, hybrid, ...
    directory: str  # tests/functional_tests/test_cases/<model>/<case> at source_commit
    golden_file: str  # golden_values_<environment>_<platform>[_2nd].json
    environment: str | None  # "dev" or "lts" (the container the run used)
    platform: str | None  # dgx_h100, dgx_a100, dgx_gb200, or a cluster (dgxa100_dracooci)
    gpu: str | None  # "H100", "A100", "GB200"; None where the name gives none
    run: int  # 1; 2 for the second, resumed run of a checkpoint-resume test (*_2nd.json)
    mode: str  # model_config.yaml MODE: "pretraining" or "rl"
    test_type: str | None  # TEST_TYPE: regular, ckpt-resume, frozen-start, release, ...
    source_commit: str  # the Megatron-LM commit read (index.json)
    pairing_commit: str  # the oldest commit whose memory series equals the newest one's
    pairing_date: str
    pairing_path: str  # the golden file's path at the pairing commit (cases get renamed)
    model_config_path: str  # model_config.yaml's path at the pairing commit
    world_size: int | None  # nodes x gpus_per_node of the recipe row; None: see reason
    nodes: int | None
    gpus_per_node: int | None
    world_size_reason: str | None  # why world_size is None (no public recipe, ...)
    training_script: str | None  # the recipe's TRAINING_SCRIPT_PATH (pretrain_gpt.py, ...)
    recipes: tuple[str, ...]  # the recipe files the launch was read from
    recipe_match: str | None  # how the recipe row was matched to this golden file
    megatron_core: str | None  # megatron/core/package_info.py at the pairing commit
    transformer_engine: str | None  # as recorded at the pairing commit (version_sources)
    container: str | None  # the base image of the environment's CI image
    vocab_size: int | None  # the tokenizer's vocabulary before padding, where known
    measured_iteration: int | None  # 2, or the first logged iteration after 1 (None: none)
    measured_bytes: int | None  # mem-max-allocated-bytes at measured_iteration
    iteration1_bytes: int | None  # mem-max-allocated-bytes at iteration 1 (None: not logged)
    logged_iterations: int  # how many iterations the golden file logged (kept: max_allocated)
    last_iteration: int  # the last one logged (its value is kept)
    model_args: Mapping[str, Any] = field(compare=False, repr=False)  # MODEL_ARGS as written
    env_vars: Mapping[str, str] = field(compare=False, repr=False)  # ENV_VARS
    # mem-max-allocated-bytes and mem-allocated-bytes by iteration: every logged iteration up
    # to 100 and the last one logged (collect.py KEEP_ITERATIONS)
    max_allocated: Mapping[int, int] = field(compare=False, repr=False)
    allocated: Mapping[int, int] | None = field(compare=False, repr=False)
    version_sources: Mapping[str, str] = field(compare=False, repr=False)
    vocab_source: str | None = field(default=None, compare=False, repr=False)
    # what was read from the case's history where its pairing commit does not say
    # (INFERENCES), with the evidence; None: nothing inferred
    inferred: str | None = field(default=None, compare=False, repr=False)

    @property
    def argv(self) -> list[str]:
        """MODEL_ARGS as the Megatron-LM command line the test runner of the pairing commit
        builds."""
        return model_args_argv(self.model_args, quote_metacharacters=(
            runner_quotes_metacharacters(self.pairing_date)))

    @property
    def scored_gpu(self) -> bool:
        """A dev, first-run golden file of a recipe platform: the board's kind of row."""
        return self.environment == "dev" and self.run == 1 \
            and self.platform in SCORED_PLATFORMS


# the commit date of Megatron-LM 7418b1b8fb (RUNNER_QUOTES_METACHARACTERS): a case paired
# with a commit before it ran under the runner that double-quoted only values with a space
_RUNNER_QUOTES_METACHARACTERS_DATE = datetime.fromisoformat("2026-02-26T23:56:45+00:00")


def runner_quotes_metacharacters(pairing_date: str) -> bool:
    """Whether a case paired with a commit of ``pairing_date`` (ISO 8601) ran under the test
    runner that double-quotes values with a shell metacharacter
    (``tracemem.frontdoors.megatron_args.run_training_words``): its date is not before
    7418b1b8fb's. The commit date stands for the order of the history (the CI's commits are
    in date order on main)."""
    return datetime.fromisoformat(pairing_date) >= _RUNNER_QUOTES_METACHARACTERS_DATE


def model_args_argv(model_args: Mapping[str, Any], *,
                    quote_metacharacters: bool = True) -> list[str]:
    """MODEL_ARGS as a command line, by the rules of
    tests/functional_tests/shell_test_utils/_run_training.sh (and
    ``tracemem.frontdoors.megatron_args_from_yaml``): ``true`` is the bare flag, ``false`` and
    an empty value leave it out, a list is several values, any other value the words the
    runner's xargs and eval make of it (``run_training_words``; ``quote_metacharacters``:
    the runner's version, ``runner_quotes_metacharacters``)."""
    from tracemem.frontdoors.megatron_args import run_training_words

    argv: list[str] = []
    for key, value in model_args.items():
        if value is True:
            argv.append(key)
        elif value is False or value == "" or value is None:
            continue
        elif isinstance(value, list):
            argv += [key, *(str(v) for v in value)]
        else:
            argv += [key, *run_training_words(key, str(value),
                                              quote_metacharacters=quote_metacharacters)]
    return argv


def _measured(series: Mapping[int, int]) -> tuple[int | None, int | None]:
    """(iteration, bytes): iteration 2, or the first logged iteration after 1; (None, None)
    when only iteration 1 is logged."""
    later = sorted(step for step in series if step > 1)
    return (later[0], series[later[0]]) if later else (None, None)


def _proxy(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Inference:
    """A launch (``nodes`` x ``gpus_per_node``, ``training_script``) and argument values
    (``model_args``: replacing MODEL_ARGS values) read from a case's history where its pairing
    commit's recipe or Megatron-Core does not give them, with the evidence (``why``). The
    board marks a case scored with one."""

    nodes: int
    gpus_per_node: int
    training_script: str
    model_args: Mapping[str, str]
    why: str


# by case name; each value a fact of the Megatron-LM history, with its commit
INFERENCES: dict[str, Inference] = {
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental@dev_dgx_h100": Inference(
        nodes=1, gpus_per_node=8, training_script="pretrain_gpt.py",
        model_args={"--pipeline-model-parallel-layout": "Et*3|(tt|)*6tmL"},
        why="8 GPUs: tests/test_utils/recipes/moe.yaml's spec (nodes 1, gpus 8, "
            "TRAINING_SCRIPT_PATH=pretrain_gpt.py) at 08abeedbfe, the last commit whose "
            "recipe lists the case (2f1027d222 comments it out: 'Disable broken tests'), with "
            "the same model_config.yaml as the pairing commit c08d89bea0 and a memory series "
            "within 0.07 % of this one at every logged iteration; the layout Et*3|(tt|)*6tmL: "
            "Megatron-Core at c08d89bea0 takes no MTP layer in a layout and builds the MTP "
            "layers on the last pipeline stage (pipeline_parallel_layer_layout.py "
            "validate_layer_layout, multi_token_prediction.py get_mtp_num_layers_to_build), "
            "as d98e8a6's model_config.yaml of the case writes it"),
}


def _cases_of(data: dict[str, Any], source_commit: str) -> list[CICase]:
    out = []
    tokenizer = data.get("tokenizer") or {}
    for golden in data["golden"]:
        config = data["model_configs"].get(golden["model_config"] or "", {})
        args = config.get("MODEL_ARGS", {})
        if golden["run"] == 2 and config.get("MODEL_ARGS_2"):
            args = config["MODEL_ARGS_2"]  # _run_training.sh: the second run's arguments
        series = golden["series"]
        peak = {int(step): int(value) for step, value in
                series["mem-max-allocated-bytes"].items()}
        current = series.get("mem-allocated-bytes")
        iteration, measured = _measured(peak)
        launch, versions = golden["launch"], golden["versions"]
        stem = golden["file"][len("golden_values_"):-len(".json")]
        name = f"{data['case']}@{stem}"
        inference = INFERENCES.get(name) if launch["world_size"] is None else None
        if inference is not None:
            launch = dict(launch, nodes=inference.nodes,
                          gpus_per_node=inference.gpus_per_node,
                          world_size=inference.nodes * inference.gpus_per_node, reason=None,
                          training_script=inference.training_script)
            args = {**args, **inference.model_args}
        out.append(CICase(
            name=name, case=data["case"], model=data["model"],
            directory=data["directory"], golden_file=golden["file"],
            environment=golden["environment"], platform=golden["platform"],
            gpu=golden["gpu"], run=golden["run"], mode=data["mode"],
            test_type=data["test_type"], source_commit=source_commit,
            pairing_commit=golden["pairing_commit"], pairing_date=golden["pairing_date"],
            pairing_path=golden["pairing_path"],
            model_config_path=config.get("path", ""),
            world_size=launch["world_size"], nodes=launch["nodes"],
            gpus_per_node=launch["gpus_per_node"], world_size_reason=launch["reason"],
            training_script=launch["training_script"],
            recipes=tuple(launch.get("recipes") or ()), recipe_match=launch.get("match"),
            megatron_core=(versions.get("megatron_core") or {}).get("value"),
            transformer_engine=(versions.get("transformer_engine") or {}).get("value"),
            container=(versions.get("container") or {}).get("value"),
            vocab_size=tokenizer.get("vocab_size"),
            measured_iteration=iteration, measured_bytes=measured,
            iteration1_bytes=peak.get(1),
            logged_iterations=golden["logged"]["iterations"],
            last_iteration=golden["logged"]["last"],
            model_args=_proxy(args), env_vars=_proxy(config.get("ENV_VARS", {})),
            max_allocated=_proxy(peak),
            allocated=None if current is None else _proxy(
                {int(step): int(value) for step, value in current.items()}),
            version_sources=_proxy({key: value["source"] for key, value in versions.items()
                                    if value}),
            vocab_source=tokenizer.get("source"),
            inferred=None if inference is None else inference.why,
        ))
    return out


@functools.cache
def load_index() -> Mapping[str, Any]:
    """index.json: the Megatron-LM commit read, the counts, and every test case directory
    (training or not, with a memory series or not, its file here or None and why)."""
    return json.loads((DATA / "index.json").read_text())


@functools.cache
def _all_cases() -> tuple[CICase, ...]:
    index = load_index()
    commit = index["source"]["commit"]
    cases: list[CICase] = []
    for entry in index["cases"]:
        if entry["file"]:
            cases += _cases_of(json.loads((DATA / entry["file"]).read_text()), commit)
    return tuple(sorted(cases, key=lambda c: c.name))


def load_cases() -> list[CICase]:
    """Every golden file with a memory series of every training test case, by name."""
    return list(_all_cases())


def case_job_kwargs(case: CICase) -> dict[str, Any]:
    """The case's ``tracemem.job.Job`` keywords, through the Megatron-LM front door
    (``tracemem.frontdoors.megatron_job_kwargs``) with its MODEL_ARGS, ENV_VARS, world size
    and, where the tokenizer file's is known, vocabulary size; with its GPU kind (``gpu``) and
    its container's PyTorch cuBLAS default (``torch_cublas_default``).

    Raises:
        TracememError: no world size (the reason), or the front door's refusal (one line,
            naming the argument or feature).
    """
    from tracemem.frontdoors import megatron_job_kwargs

    if case.world_size is None:
        raise TracememError(f"{case.name}: no world size: {case.world_size_reason}")
    kwargs = megatron_job_kwargs(case.argv, env=dict(case.env_vars),
                                 world_size=case.world_size, vocab_size=case.vocab_size)
    return kwargs | {"gpu": case.gpu,
                     "torch_cublas_default": (torch_cublas_default(case.container)
                                              if case.gpu else "2.13")}


# The first NGC PyTorch container (YY.MM) whose torch has pytorch/pytorch#175344 (the module
# docstring, "PyTorch in the container": the evidence)
_FIRST_CONTAINER_WITH_175344 = (26, 4)


def torch_cublas_default(container: str | None) -> str:
    """The ``Job.torch_cublas_default`` of a run in ``container``
    (``nvcr.io/nvidia/pytorch:YY.MM-py3``): "sm90" up to 26.02, "2.13" from 26.04 (the module
    docstring, "PyTorch in the container"); "2.13", tracemem's torch, where the container is
    not recorded or not an NGC PyTorch tag."""
    import re

    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", container or "")
    if match is None:
        return "2.13"
    return ("sm90" if (int(match[1]), int(match[2])) < _FIRST_CONTAINER_WITH_175344
            else "2.13")


def _data_reason(case: CICase) -> str | None:
    """Why the board does not score this golden file, before asking the front door."""
    if case.run == 2:
        return ("the second, resumed run of a checkpoint-resume test (*_2nd.json): it starts "
                "from the checkpoint, optimizer state included")
    if case.environment != "dev":
        return f"environment {case.environment} (the long-term-support container); the " \
               f"board scores dev golden values"
    if case.platform is None:
        return f"no platform in the name {case.golden_file} (no recipe names it)"
    if case.platform not in SCORED_PLATFORMS:
        return f"cluster {case.platform}'s copy ({case.gpu}); the board scores the " \
               f"recipe platforms {', '.join(SCORED_PLATFORMS)}"
    if case.measured_bytes is None:
        return "only iteration 1 is logged (no step with the optimizer state present)"
    if case.mode != "pretraining":
        return f"MODE {case.mode} (train_rl.py: GRPO, an inference engine in the process)"
    if case.world_size is None:
        return f"no world size: {case.world_size_reason}"
    if case.training_script != "pretrain_gpt.py":
        return f"training script {case.training_script} (the Megatron-LM front door is " \
               f"pretrain_gpt.py's GPTModel)"
    if case.test_type in ("frozen-start", "frozen-resume"):
        return f"test type {case.test_type}: it starts from a stored checkpoint, whose " \
               f"loading is inside the process's peak"
    if case.test_type == "checkpoint-consistency":
        return "test type checkpoint-consistency (runs at several GPU counts)"
    return None


def selection() -> tuple[list[CICase], list[tuple[CICase, str]]]:
    """(the cases the board scores, every other case with the one-line reason it is left
    out). Scored: dev golden values of a recipe platform, first runs, GPT training that the
    front door accepts; H100 first, then A100, then GB200, each by name. Left out: every other
    golden file, with the first thing that stops it (this module's or the front door's)."""
    scored: list[CICase] = []
    left_out: list[tuple[CICase, str]] = []
    for case in _all_cases():
        reason = _data_reason(case)
        if reason is None:
            try:
                case_job_kwargs(case)
            except TracememError as error:
                reason = " ".join(str(error).split())
        if reason is None:
            scored.append(case)
        else:
            left_out.append((case, reason))
    scored.sort(key=lambda c: (_GPU_ORDER.get(c.gpu or "", 9), c.name))
    left_out.sort(key=lambda pair: (_GPU_ORDER.get(pair[0].gpu or "", 9), pair[0].name))
    return scored, left_out
