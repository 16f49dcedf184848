"""A user's layer that fails (``--replace``): its constructor or its forward raises, its forward
returns another shape than its input (llama-tiny: h 64), or its file exits on import: one line
naming the slot, the factory and the cause, exit 2, never a traceback (fresh-user findings)."""

from __future__ import annotations

import re

import torch

import pytest

from modeling import load_config
from modeling.common.model import build_model
from tracemem.cli import main
from tracemem.errors import TracememError


class Boom:
    """A factory whose construction fails, as a half-written layer does."""

    def __init__(self, ctx):
        raise RuntimeError("boom\nsecond line")


def test_a_factory_that_raises_is_one_line():
    with pytest.raises(TracememError, match=r"^--replace attn=Boom: building it raised "
                                            r"RuntimeError: boom$"):
        build_model(load_config("deepseek-tiny"), replace={"attn": Boom})


def test_a_factory_that_raises_exits_2_in_one_line(capsys):
    args = ["estimate", "--model", "llama-tiny", "--world-size", "1", "--micro-batch-size", "1",
            "--seq-length", "8", "--num-microbatches", "1",
            "--replace", "attn=tests.tracemem.test_replace_errors:Boom"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "building it raised RuntimeError: boom" in err


class RaisesInForward(torch.nn.Module):
    """Builds, then fails while the model runs (its own exception)."""

    def __init__(self, ctx):
        super().__init__()

    def forward(self, x):
        raise RuntimeError("boom in forward")


class WrongShape(torch.nn.Module):
    """Returns (b, s, 7) where the residual add needs (b, s, h)."""

    def __init__(self, ctx):
        super().__init__()

    def forward(self, x):
        return x[..., :7]


@pytest.mark.parametrize("name, message", [
    ("RaisesInForward", r"its forward raised RuntimeError: boom in forward"),
    ("WrongShape", r"its forward returned \(1, 8, 7\) for an input of \(1, 8, 64\); it "
                   r"must return the input's shape"),
])
def test_a_layer_that_fails_while_running_exits_2_in_one_line(name, message, capsys):
    args = ["estimate", "--model", "llama-tiny", "--world-size", "1", "--micro-batch-size", "1",
            "--seq-length", "8", "--num-microbatches", "1",
            "--replace", f"attn=tests.tracemem.test_replace_errors:{name}"]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and re.search(message, err)


def test_a_file_that_exits_on_import_is_one_line(tmp_path, capsys):
    script = tmp_path / "exits.py"
    script.write_text("raise SystemExit(5)\n")
    args = ["estimate", "--model", "llama-tiny", "--world-size", "1", "--micro-batch-size", "1",
            "--seq-length", "8", "--num-microbatches", "1", "--replace", f"attn={script}:X"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed: SystemExit: 5" in err
