"""The README as a new user reads it (issue 16 item 1): the first screen is the two make commands,
how to run tracemem from the venv, then `make demo`'s output (table, legend, verdict, what would
fit); every example command is one the CLI accepts as written, and every Python example runs.

Reference: the README itself, the Makefile's DEMO_ARGS, and the CLI's own parser.
"""

import re
import shlex
from pathlib import Path

import pytest

from tracemem.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    """The `tracemem ...` commands of a shell block, continuation lines joined."""
    text = block.replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith("tracemem ")]


def test_first_screen_is_commands_venv_then_the_demo_output():
    (lang, first), *_ = BLOCKS
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] \
        == ["make demo", "make test"]
    venv = README.index(".venv/bin/tracemem")
    assert README.index("source .venv/bin/activate") > venv > README.index(first)
    output = next(body for _, body in BLOCKS if "Memory columns in" in body)
    assert README.index(output) > venv
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "ranks"])
    rows = [line for line in lines[header + 2:] if line.strip()[:1].isdigit()]
    assert len(rows) == 16  # one row per pipeline stage
    order = ["Memory columns in GiB", "peak: ", "ranks: ", "EP ranks: ", "grads: ",
             "at step: ", "--wide adds ", "Verdict: ", "What would fit in 80 GiB"]
    positions = [output.index(marker) for marker in order]
    assert positions == sorted(positions) and positions[0] > output.index(rows[-1])
    # issue 26: the tables fit a terminal of 100 columns (the estimate's and what-fits')
    change = next(i for i, line in enumerate(lines) if line.startswith("change "))
    end = next(i for i, line in enumerate(lines) if line.startswith("peak: the worst rank's"))
    tables = lines[header:header + 2 + len(rows)] + lines[change:end]
    assert end - change >= 2 + 6  # the what-fits table: its 6 changes
    assert max(len(line) for line in tables) <= 100
    assert lines[header].split() == ["stage", "ranks", "params", "grads", "optimizer",
                                     "activations", "in-flight", "peak", "at", "step",
                                     "reserved", "fits"]
    assert re.search(r"Verdict: \d+ of 16 pipeline stages exceed 80 GiB \(stages [0-9-,]+\); "
                     r"the worst is stage \d+ at [0-9.]+ GiB; the most a rank needs is [0-9.]+ GiB "
                     r"\(reserved \+ non-PyTorch memory\)\.", output)
    assert "--recompute full" in output.split("What would fit")[1]


def test_the_pasted_demo_is_the_makefile_command():
    makefile = (ROOT / "Makefile").read_text()
    args = makefile[makefile.index("DEMO_ARGS ="):].split("\n\n")[0]
    demo_args = shlex.split(args.replace("DEMO_ARGS =", "").replace("\\\n", " "))
    pasted = next(cmd for _, body in BLOCKS for cmd in _commands(body)
                  if cmd[:2] == ["tracemem", "estimate"] and "deepseek-v3" in cmd)
    assert pasted[2:] == demo_args


def test_every_example_command_parses_as_written():
    parser = build_parser()
    commands = [cmd for _, body in BLOCKS for cmd in _commands(body)
                if not any("[" in part or part.isupper() for part in cmd)]  # not the synopsis
    assert len(commands) >= 2
    for cmd in commands:
        parser.parse_args(cmd[1:])  # exits 2 on a flag the CLI does not accept
        for part in cmd:  # an @FILE of Megatron arguments is a file in the repository
            if part.startswith("@"):
                assert (ROOT / part[1:]).is_file(), part


def test_the_synopsis_names_the_current_commands():
    synopsis = next(body for _, body in BLOCKS if "tracemem validate" in body)
    names = {cmd[1] for cmd in _commands(synopsis)}
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "toy" in names and "demo" not in names and names <= set(sub)
    assert "--what-fits" in synopsis and "--units auto|GiB|GB|MiB|KiB|B" in synopsis


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_python_examples_run(index):
    exec(compile(BLOCKS[index][1], f"README.md python block {index}", "exec"), {})
