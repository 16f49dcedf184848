"""A user's layer whose own constructor raises (``--replace``): one line naming the slot, the
factory and the exception, exit 2, never a traceback (a fresh-user finding)."""

from __future__ import annotations

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
