"""Regenerate the Megatron-LM CI memory data (this folder's ``*.json``) from a Megatron-LM clone.

Not run by the tests (it needs a clone of github.com/NVIDIA/Megatron-LM and minutes of git):

    .venv/bin/python tracemem/validation/megatron_ci/collect.py --repo PATH [--commit REV]

``PATH`` is a clone (a bare one is enough); ``REV`` the commit to read (default HEAD). It
writes one ``<case>.json`` per training test case whose golden values hold a memory series,
and ``index.json`` listing every test case directory. What each field means and where it comes
from: README.md beside this file, and ``tracemem/validation/megatron_ci.py``'s docstring.

For every golden file of a case it walks ``git log --follow`` from REV back and takes as the
**pairing commit** the oldest commit of the unbroken run, from the newest version back, whose
``mem-max-allocated-bytes`` and ``mem-allocated-bytes`` values are the same numbers,
iteration by iteration, as the newest version's (the last commit to touch a golden file is
often a rename or a loss-only update). At that commit it reads the case's
``model_config.yaml``, the recipes (tests/test_utils/recipes/**.yaml, or
tests/functional_tests/jet_recipes/*.yaml before them) for the nodes and GPUs per node, and
the versions recorded in the tree (megatron/core/package_info.py, docker/.ngc_version.*,
uv.lock, docker/Dockerfile.ci.*).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CASES = "tests/functional_tests/test_cases"
RECIPE_DIRS = ("tests/test_utils/recipes", "tests/functional_tests/jet_recipes")
MEMORY_KEYS = ("mem-max-allocated-bytes", "mem-allocated-bytes")
FORMAT = "tracemem megatron-ci case v1"
REPOSITORY = "https://github.com/NVIDIA/Megatron-LM"

# golden_values_{environment}_{platforms}.json (the recipes' GOLDEN_VALUES_PATH), with
# "_2nd" for the second (resumed) run of a checkpoint-resume test (run_ci_test.sh writes
# "$(basename $GOLDEN_VALUES_PATH .json)_2nd.json"); older files have no platform
GOLDEN_NAME = re.compile(r"^golden_values_(?P<environment>dev|lts)"
                         r"(?:_(?P<platform>.+?))?(?P<second>_2nd)?\.json$")

# platform or cluster name in a golden file's name -> GPU kind. dgx_* are the recipes'
# platforms; dgxa100_dracooci(-ord) are A100 clusters (recipe_parser.py
# resolve_cluster_config: draco-oci-iad / draco-oci-ord), dgxh100_dgxc an H100 cluster
# (launch_nemo_run_workload.py CLUSTER "dgxh100_dgxc")
GPU_OF_PLATFORM = {"dgx_h100": "H100", "dgx_a100": "A100", "dgx_gb200": "GB200",
                   "dgxa100_dracooci": "A100", "dgxa100_dracooci-ord": "A100",
                   "dgxh100_dgxc": "H100", "dgxh100_eos": "H100", "dgxh100_coreweave": "H100",
                   "dgxgb200_oci-hsg": "GB200"}

# The GPT-2 BPE vocabulary the functional tests' data sets ship (bpe/vocab.json beside
# merges.txt): tools/common_pile_dataset/README.md ("vocab.json  # GPT-2 BPE vocabulary",
# copied from the_pile); Megatron's GPT2BPETokenizer is Hugging Face's "gpt2" tokenizer
# (megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py MEGATRON_CONFIG_MAP), whose
# vocabulary has 50,257 entries; commit c9dfe34798 replaced this very vocab.json with
# "--tokenizer-type NullTokenizer --vocab-size 50257" in gpt3_mcore_te_tp2_pp2_cp2.
GPT2_VOCAB = {"vocab_size": 50257,
              "source": "GPT-2 BPE vocabulary (tools/common_pile_dataset/README.md; "
                        "megatron_hf_tokenizer.py MEGATRON_CONFIG_MAP['GPT2BPETokenizer']; "
                        "commit c9dfe34798 swaps it for NullTokenizer --vocab-size 50257)"}


class Git:
    """A repository read through ``git`` subprocesses; blobs through one ``cat-file --batch``
    per thread."""

    def __init__(self, repo: Path):
        self.repo = repo
        self._local = threading.local()

    def run(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.repo), *args], check=True,
                              capture_output=True, text=True).stdout

    def show(self, commit: str, path: str) -> str | None:
        """The blob at ``commit:path`` as text, or None when there is none."""
        proc = getattr(self._local, "proc", None)
        if proc is None:
            proc = subprocess.Popen(["git", "-C", str(self.repo), "cat-file", "--batch"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._local.proc = proc
        proc.stdin.write(f"{commit}:{path}\n".encode())
        proc.stdin.flush()
        header = proc.stdout.readline().decode().split()
        if len(header) < 3 or header[1] != "blob":
            return None
        size = int(header[2])
        data = proc.stdout.read(size)
        proc.stdout.read(1)  # the newline after each object
        return data.decode("utf-8", errors="replace")

    def blob_id(self, commit: str, path: str) -> str | None:
        try:
            return self.run("rev-parse", f"{commit}:{path}").strip()
        except subprocess.CalledProcessError:
            return None


class Yaml12Loader(yaml.SafeLoader):
    """YAML as ``yq`` hands it to the test runner (_run_training.sh): only true / false are
    booleans; every other scalar stays as written (``1e-6``, ``.01``, ``0001``, ``8``)."""


Yaml12Loader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers
          if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                         "tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                   re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def _plain(value: Any) -> Any:
    """A YAML value as JSON data: mappings and lists kept, scalars as written."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool):
        return value
    return str(value)


def _env_value(value: Any) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    return "" if value is None else str(value)


def parse_model_config(text: str) -> dict[str, Any]:
    """MODEL_ARGS (and MODEL_ARGS_2, the second run's, where present), ENV_VARS, MODE,
    TEST_TYPE of a model_config.yaml."""
    data = yaml.load(text, Loader=Yaml12Loader) or {}
    out: dict[str, Any] = {"MODEL_ARGS": _plain(data.get("MODEL_ARGS") or {}),
                           "ENV_VARS": {str(k): _env_value(v)
                                        for k, v in (data.get("ENV_VARS") or {}).items()}}
    if "MODEL_ARGS_2" in data:
        out["MODEL_ARGS_2"] = _plain(data.get("MODEL_ARGS_2") or {})
    for key in ("MODE", "TEST_TYPE", "LAUNCHER"):
        if key in data:
            out[key] = _env_value(data[key])
    return out


def memory_series(doc: Any) -> dict[str, Any] | None:
    """The golden file's memory metrics, each {iteration: value} as the file holds them (the
    comparison key of the pairing walk), or None when there is no mem-max-allocated-bytes."""
    if not isinstance(doc, dict) or "mem-max-allocated-bytes" not in doc:
        return None
    out: dict[str, Any] = {}
    for key in MEMORY_KEYS:
        metric = doc.get(key)
        if metric is None:
            continue
        values = metric.get("values") if isinstance(metric, dict) else None
        if isinstance(values, dict):
            out[key] = {int(step): value for step, value in values.items()}
        else:  # an older layout (a list from start_step by step_interval): compared as is
            out[key] = json.dumps(metric, sort_keys=True)
    return out


def history(git: Git, commit: str, path: str) -> list[tuple[str, str, str]]:
    """(commit, commit date, the file's path at that commit), newest first, through renames."""
    text = git.run("log", "--follow", "--format=%x01%H %cI", "--name-only", commit, "--", path)
    out = []
    kind = _kind(path)
    for block in text.split("\x01")[1:]:
        lines = [line for line in block.splitlines() if line.strip()]
        sha, date = lines[0].split()
        old_path = lines[1] if len(lines) > 1 else path
        # --follow takes the most similar file as the rename source; two golden files of
        # the same numbers (one A100 run copied for two clusters) look renamed into each
        # other, so a rename to another environment or platform ends the history here
        old_kind = _kind(old_path)
        if old_kind != kind and not (old_kind[1] is None and old_kind[0] == kind[0]):
            break
        out.append((sha, date, old_path))
    return out


def _kind(path: str) -> tuple[str | None, str | None, bool]:
    """(environment, platform, second run) of a golden file's name."""
    parsed = GOLDEN_NAME.match(path.rsplit("/", 1)[-1])
    if not parsed:
        return (None, None, False)
    return (parsed.group("environment"), parsed.group("platform"),
            bool(parsed.group("second")))


def pairing(git: Git, head: str, path: str) -> dict[str, Any]:
    """The pairing commit of one golden file (module docstring) and the newest version's
    memory series."""
    versions = history(git, head, path)
    newest_text = git.show(head, path)
    newest = memory_series(json.loads(newest_text))
    pair = (head, versions[0][1] if versions else None, path)
    walked = 0
    differs = None
    for sha, date, old_path in versions:
        text = git.show(sha, old_path)
        try:
            series = memory_series(json.loads(text)) if text else None
        except json.JSONDecodeError:
            series = None
        walked += 1
        if series != newest:
            differs = sha
            break
        pair = (sha, date, old_path)
    return {"series": newest, "pairing_commit": pair[0], "pairing_date": pair[1],
            "pairing_path": pair[2], "newest_commit": versions[0][0] if versions else None,
            "versions_compared": walked, "older_values_differ_at": differs,
            "commits_touching_file": len(versions)}


# ---- recipes ------------------------------------------------------------------------------

def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def flatten_recipe(doc: dict) -> list[dict]:
    """One row per (test case, product) of a recipe, the spec's keys overridden by the row's,
    as tests/test_utils/python_scripts/recipe_parser.py ``flatten_products`` /
    ``flatten_workload`` expand them (a cartesian product of each products entry's lists)."""
    spec = doc.get("spec") or {}
    rows = []
    for product in doc.get("products") or []:
        if not isinstance(product, dict):
            continue
        inner = product.get("products")
        outer = {k: v for k, v in product.items() if k != "products"}
        entries = inner if isinstance(inner, list) else [{}]
        for entry in entries:
            merged = {**outer, **(entry or {})}
            keys = [k for k in merged if k != "cadence"]
            for combo in itertools.product(*(_as_list(merged[k]) for k in keys)):
                row = dict(spec)
                row.update(zip(keys, combo))
                rows.append(row)
    return rows


def _script_value(spec: dict, name: str) -> str | None:
    script = "\n".join(str(spec.get(k) or "") for k in ("script", "script_setup"))
    found = re.search(rf'"?{name}=([^"\s]+)"?', script)
    return found.group(1) if found else None


def _fill(template: str, row: dict) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: str(row.get(m.group(1), m.group(0))), template)


class Recipes:
    """The recipes of one commit, flattened (cached per commit)."""

    def __init__(self, git: Git):
        self.git = git
        self._cache: dict[str, list[tuple[str, dict]]] = {}
        self._lock = threading.Lock()

    def rows(self, commit: str) -> list[tuple[str, dict]]:
        with self._lock:
            if commit in self._cache:
                return self._cache[commit]
        out = []
        for folder in RECIPE_DIRS:
            try:
                names = self.git.run("ls-tree", "-r", "--name-only", commit, folder).split()
            except subprocess.CalledProcessError:
                continue
            for name in names:
                if not name.endswith((".yaml", ".yml")) or "/_" in name:
                    continue  # _build-*.yaml, _cleanup.yaml: not test recipes
                try:
                    doc = yaml.safe_load(self.git.show(commit, name) or "")
                except yaml.YAMLError:
                    continue
                if isinstance(doc, dict) and doc.get("type", "basic") == "basic":
                    out += [(name, row) for row in flatten_recipe(doc)]
        with self._lock:
            self._cache[commit] = out
        return out


def launch(recipes: Recipes, commit: str, model: str, case: str, golden_name: str,
           environment: str, gpu: str | None) -> dict[str, Any]:
    """Nodes and GPUs per node of the recipe row that runs this golden file at ``commit``."""
    rows = [(name, row) for name, row in recipes.rows(commit)
            if row.get("test_case") == case and row.get("model", model) == model]
    if not rows:
        return {"nodes": None, "gpus_per_node": None, "world_size": None, "recipes": [],
                "training_script": None, "match": None,
                "reason": f"no recipe at {commit[:10]} lists test case {case} (its GPU count "
                          f"is not public)"}

    def expected(row: dict) -> str | None:
        template = _script_value(row, "GOLDEN_VALUES_PATH")
        return _fill(template, row).rsplit("/", 1)[-1] if template else None

    exact = [(n, r) for n, r in rows if expected(r) in (golden_name,
                                                         golden_name.replace("_2nd.json",
                                                                             ".json"))]
    match = "the recipe row whose GOLDEN_VALUES_PATH names this file"
    chosen = exact
    if not chosen and gpu is None:
        return {"nodes": None, "gpus_per_node": None, "world_size": None,
                "recipes": sorted({n for n, _ in rows}), "training_script": None,
                "match": None,
                "reason": f"no recipe row at {commit[:10]} names {golden_name} (they name "
                          f"{', '.join(sorted({str(expected(r)) for _, r in rows}))}), and "
                          f"its name gives no GPU kind"}
    if not chosen:
        chosen = [(n, r) for n, r in rows if r.get("environment") == environment
                  and GPU_OF_PLATFORM.get(str(r.get("platforms"))) == gpu and gpu]
        match = (f"a recipe row of this test case, environment {environment} and GPU kind "
                 f"{gpu} (no row names this file: its platform is not a recipe platform)")
    if not chosen and gpu in ("A100", "H100"):
        # the recipes under h100/ give a test case's DGX A100 and DGX H100 rows one spec; a
        # golden file of one of them with only the other's row at the pairing commit (the
        # file was written before the commit that renamed it) takes that row's GPU count
        chosen = [(n, r) for n, r in rows
                  if GPU_OF_PLATFORM.get(str(r.get("platforms"))) in ("A100", "H100")]
        match = (f"a recipe row of this test case on another DGX platform "
                 f"({', '.join(sorted({str(r.get('platforms')) for _, r in chosen}))}): "
                 f"no row runs it as {environment} {gpu} at this commit")
    if not chosen:
        listed = sorted({f"{r.get('environment')}_{r.get('platforms')}" for _, r in rows})
        return {"nodes": None, "gpus_per_node": None, "world_size": None,
                "recipes": sorted({n for n, _ in rows}), "training_script": None,
                "match": None,
                "reason": f"the recipes at {commit[:10]} run {case} only as "
                          f"{', '.join(listed)}, not as this file's {environment} {gpu}"}
    sizes = sorted({(r.get("nodes"), r.get("gpus")) for _, r in chosen}, key=str)
    scripts = sorted({str(_script_value(r, "TRAINING_SCRIPT_PATH")) for _, r in chosen})
    out = {"recipes": sorted({n for n, _ in chosen}), "match": match,
           "training_script": scripts[0] if len(scripts) == 1 else None,
           "_rows": [r for _, r in chosen]}
    if len(sizes) != 1 or not all(isinstance(v, int) for v in sizes[0]):
        return {**out, "nodes": None, "gpus_per_node": None, "world_size": None,
                "reason": f"recipes disagree or give no integers: nodes, gpus = {sizes}"}
    nodes, gpus = sizes[0]
    return {**out, "nodes": nodes, "gpus_per_node": gpus, "world_size": nodes * gpus,
            "reason": None}


# ---- versions -----------------------------------------------------------------------------

def versions(git: Git, commit: str, environment: str) -> dict[str, Any]:
    """Megatron-Core, Transformer Engine and container versions recorded in the tree."""
    out: dict[str, Any] = {}
    info = git.show(commit, "megatron/core/package_info.py") or ""
    parts = {k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)['\"]?", info, re.M)
             for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
    if all(parts[k] for k in ("MAJOR", "MINOR", "PATCH")):
        value = ".".join(parts[k].group(1).strip() for k in ("MAJOR", "MINOR", "PATCH"))
        value += parts["PRE_RELEASE"].group(1).strip() if parts["PRE_RELEASE"] else ""
        out["megatron_core"] = {"value": value, "source": "megatron/core/package_info.py"}
    else:
        out["megatron_core"] = None
    container = None
    ngc = git.show(commit, f"docker/.ngc_version.{environment}")
    if ngc and ngc.strip():
        container = {"value": ngc.strip().splitlines()[0],
                     "source": f"docker/.ngc_version.{environment} (the base image)"}
    else:
        docker = git.show(commit, f"docker/Dockerfile.ci.{environment}") or ""
        found = re.search(r"^ARG FROM_IMAGE_NAME=(\S+)", docker, re.M)
        if found:
            container = {"value": found.group(1),
                         "source": f"docker/Dockerfile.ci.{environment} ARG FROM_IMAGE_NAME"}
    if container is None:  # before docker/.ngc_version.*: the CI's image build matrix
        container = _build_matrix_image(git, commit, environment)
    out["container"] = container
    te = None
    for dockerfile in (f"docker/Dockerfile.ci.{environment}", f"Dockerfile.ci.{environment}"):
        docker = git.show(commit, dockerfile) or ""
        found = re.search(r"transformer-engine\s*@\s*git\+\S+?@([0-9a-f]{7,40})", docker) \
            or re.search(r"^ARG TE_COMMIT=([0-9a-f]{7,40})", docker, re.M)
        if found:
            te = {"value": f"git {found.group(1)}",
                  "source": f"{dockerfile} (TransformerEngine commit it builds)"}
            break
    if te is None:
        lock = git.show(commit, "uv.lock") or ""
        found = re.search(r'\[\[package\]\]\nname = "transformer-engine"\nversion = "([^"]+)"',
                          lock)
        if found:
            te = {"value": found.group(1), "source": "uv.lock [[package]] transformer-engine"
                  + (" (the dev lock; the lts image may install another)"
                     if environment == "lts" else "")}
    out["transformer_engine"] = te
    return out


def _build_matrix_image(git: Git, commit: str, environment: str) -> dict[str, str] | None:
    """The BASE_IMAGE of the CI_MCORE_<ENV>_IMAGE build in the GitLab CI files (before
    docker/.ngc_version.* existed)."""
    want = f"CI_MCORE_{environment.upper()}_IMAGE"
    try:
        names = git.run("ls-tree", "--name-only", commit, ".gitlab/stages/").split()
    except subprocess.CalledProcessError:
        names = []
    for name in [".gitlab-ci.yml", *names]:
        try:
            doc = yaml.safe_load(git.show(commit, name) or "")
        except yaml.YAMLError:
            continue
        stack, images = [doc], set()
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("IMAGE") == want and node.get("BASE_IMAGE"):
                    images.add(str(node["BASE_IMAGE"]))
                stack += list(node.values())
            elif isinstance(node, list):
                stack += node
        if len(images) == 1:
            return {"value": images.pop(), "source": f"{name} (BASE_IMAGE of {want})"}
    return None


# ---- cases --------------------------------------------------------------------------------

def tokenizer(model_args: dict[str, Any]) -> dict[str, Any]:
    """The vocabulary size where the tokenizer file's is known (GPT2_VOCAB), else why not."""
    kind = model_args.get("--tokenizer-type")
    vocab_file = str(model_args.get("--vocab-file") or "")
    if kind in (None, "GPT2BPETokenizer") and vocab_file.endswith("bpe/vocab.json") \
            and model_args.get("--merge-file"):
        return {"type": "GPT2BPETokenizer", "file": vocab_file, **GPT2_VOCAB}
    if kind == "NullTokenizer" or "--vocab-size" in model_args:
        return {"type": kind, "file": None, "vocab_size": None,
                "source": "--vocab-size in MODEL_ARGS"}
    return {"type": kind, "file": model_args.get("--tokenizer-model") or vocab_file or None,
            "vocab_size": None, "source": "the tokenizer file is not in the repository"}


KEEP_ITERATIONS = 100  # iterations kept in full; after them only the last logged one


def kept_series(series: dict[str, Any]) -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    """The memory series as kept here, bytes as ``int``: every logged iteration up to
    KEEP_ITERATIONS and the last logged one (release tests log 20,000); "nan" entries (the
    iterations a resumed second run or a failed window did not log) dropped. And what was
    logged: how many iterations, the last, how many "nan"."""
    kept: dict[str, dict[str, int]] = {}
    logged: dict[str, Any] = {}
    for key, values in series.items():
        if not isinstance(values, dict):
            continue
        numbers = {step: value for step, value in values.items()
                   if isinstance(value, (int, float)) and value == value}
        steps = sorted(numbers)
        if not steps:
            continue
        keep = [step for step in steps if step <= KEEP_ITERATIONS] + \
            ([steps[-1]] if steps[-1] > KEEP_ITERATIONS else [])
        kept[key] = {str(step): int(numbers[step]) for step in keep}
        if key == "mem-max-allocated-bytes":
            logged = {"iterations": len(steps), "first": steps[0], "last": steps[-1],
                      "nan": len(values) - len(steps), "kept": len(keep)}
    return kept, logged


def golden_entry(git: Git, recipes: Recipes, head: str, model: str, path: str,
                 configs: dict[str, Any]) -> dict[str, Any]:
    name = path.rsplit("/", 1)[-1]
    parsed = GOLDEN_NAME.match(name)
    environment = parsed.group("environment") if parsed else None
    platform = parsed.group("platform") if parsed else None
    gpu = GPU_OF_PLATFORM.get(platform or "")
    pair = pairing(git, head, path)
    commit, old_path = pair["pairing_commit"], pair["pairing_path"]
    old_dir, old_name = old_path.rsplit("/", 1)
    config_path = f"{old_dir}/model_config.yaml"
    blob = git.blob_id(commit, config_path)
    if blob and blob not in configs:
        configs[blob] = {"path": config_path, "commit": commit,
                         **parse_model_config(git.show(commit, config_path) or "")}
    run = launch(recipes, commit, model, old_dir.rsplit("/", 1)[-1], old_name,
                 environment or "", gpu)
    if platform is None and (run.get("match") or "").startswith("the recipe row whose"):
        # no platform in the name (an older layout), but a recipe row names this file:
        # its platform is the GPU kind
        kinds = sorted({str(r.get("platforms")) for r in run.pop("_rows")})
        if len(kinds) == 1:
            gpu = GPU_OF_PLATFORM.get(kinds[0])
    run.pop("_rows", None)
    series, logged = kept_series(pair["series"] or {})
    return {
        "file": name, "environment": environment, "platform": platform, "gpu": gpu,
        "run": 2 if parsed and parsed.group("second") else 1,
        "pairing_commit": commit, "pairing_date": pair["pairing_date"],
        "pairing_path": old_path, "newest_commit": pair["newest_commit"],
        "commits_touching_file": pair["commits_touching_file"],
        "older_values_differ_at": pair["older_values_differ_at"],
        "model_config": blob,
        "launch": run,
        "versions": versions(git, commit, environment or "dev"),
        "logged": logged,
        "series": series,
    }


def collect_case(git: Git, recipes: Recipes, head: str, directory: str,
                 files: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the index entry, the case's JSON or None) of one test case directory."""
    model, case = directory.split("/")[-2:]
    goldens = sorted(f for f in files if f.startswith("golden_values"))
    entry: dict[str, Any] = {"case": case, "model": model, "directory": directory,
                             "golden_files": goldens}
    if "model_config.yaml" not in files:
        return {**entry, "mode": None, "test_type": None, "training": False,
                "memory_series": False, "file": None,
                "reason": "no model_config.yaml (not a training or inference test case)"}, None
    config = parse_model_config(git.show(head, f"{directory}/model_config.yaml") or "")
    mode = config.get("MODE", "pretraining")
    entry.update(mode=mode, test_type=config.get("TEST_TYPE"),
                 training=mode != "inference")
    with_memory, empty, without = [], [], []
    for name in goldens:
        text = git.show(head, f"{directory}/{name}") or ""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            empty.append(name)
            continue
        (with_memory if memory_series(doc) else without).append(name)
    entry["memory_series"] = bool(with_memory)
    if empty:
        entry["unreadable_golden_files"] = empty
    if mode == "inference":
        return {**entry, "file": None, "reason": "MODE inference (not a training run)"}, None
    if not with_memory:
        return {**entry, "file": None,
                "reason": "no golden file holds mem-max-allocated-bytes"}, None
    configs: dict[str, Any] = {}
    golden = [golden_entry(git, recipes, head, model, f"{directory}/{name}", configs)
              for name in with_memory]
    data = {"format": FORMAT, "case": case, "model": model, "directory": directory,
            "source": {"repository": REPOSITORY, "commit": head},
            "mode": mode, "test_type": config.get("TEST_TYPE"),
            "tokenizer": tokenizer(config["MODEL_ARGS"]),
            "golden_without_memory": without, "golden": golden, "model_configs": configs}
    return {**entry, "file": f"{case}.json", "reason": None}, data


def dumps_case(data: dict[str, Any]) -> str:
    """The case as indented JSON with each memory series on one line (the files stay small
    and a value is found by its iteration: ``"2": 2108270592``)."""
    lines: dict[str, str] = {}
    for g, golden in enumerate(data["golden"]):
        for key, values in golden["series"].items():
            token = f"@series-{g}-{key}@"
            lines[json.dumps(token)] = json.dumps(values, separators=(", ", ": "))
            golden["series"][key] = token
    text = json.dumps(data, indent=1)
    for token, line in lines.items():
        text = text.replace(token, line)
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, type=Path,
                        help="a clone of github.com/NVIDIA/Megatron-LM (bare is enough)")
    parser.add_argument("--commit", default="HEAD", help="the commit to read (default HEAD)")
    parser.add_argument("--out", type=Path, default=HERE, help="the folder to write")
    parser.add_argument("--jobs", type=int, default=4, help="git processes in parallel")
    parser.add_argument("--only", default=None, help="only case directories matching this "
                                                     "regular expression (for a quick look)")
    args = parser.parse_args(argv)
    if args.only and args.out.resolve() == HERE:
        parser.error("--only writes some cases and no index: give another --out")
    git = Git(args.repo)
    head = git.run("rev-parse", args.commit).strip()
    date = git.run("log", "-1", "--format=%cI", head).strip()
    recipes = Recipes(git)
    names = git.run("ls-tree", "-r", "--name-only", head, CASES).split()
    dirs: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        if len(parts) >= 6:
            dirs.setdefault("/".join(parts[:5]), []).append("/".join(parts[5:]))
    chosen = sorted(d for d in dirs if not args.only or re.search(args.only, d))
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda d: collect_case(git, recipes, head, d, dirs[d]),
                                chosen))
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only:
        for old in args.out.glob("*.json"):
            old.unlink()
    index = []
    for entry, data in results:
        index.append(entry)
        if data is not None:
            (args.out / entry["file"]).write_text(dumps_case(data))
    summary = {
        "case_directories": len(index),
        "with_model_config": sum(e["mode"] is not None for e in index),
        "inference": sum(e["mode"] == "inference" for e in index),
        "training": sum(bool(e["training"]) for e in index),
        "training_with_memory_series": sum(bool(e["file"]) for e in index),
    }
    if not args.only:
        (args.out / "index.json").write_text(json.dumps(
            {"format": "tracemem megatron-ci index v1",
             "source": {"repository": REPOSITORY, "commit": head, "date": date,
                        "read_by": "tracemem/validation/megatron_ci/collect.py"},
             "counts": summary, "cases": index}, indent=1) + "\n")
    print(json.dumps(summary), f"{time.time() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
