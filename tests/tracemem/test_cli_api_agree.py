"""The CLI passes values to the Python API, which alone validates them (issue 9 item 5): the
flags become a ``Job``, and the ``Job`` validates (issue 20).

Reference: the house rule "the CLI passes values to the Python API, which alone validates
them"; issue 9 item 5's case (``estimate(..., rounding=0)`` raised while ``--rounding 0``
worked). For every valued flag of ``tracemem estimate``, edge values are driven through the CLI
with the ``Job`` replaced by a recorder: every value argparse can parse reaches the Job field
unchanged (so the CLI accepts exactly what the API accepts); then the real API and the real CLI
agree on the edge cases themselves.
"""

import re

import pytest

import tracemem.job
from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.estimator import estimate

BASE = {"--model": "deepseek-tiny", "--world-size": "1", "--micro-batch-size": "1",
        "--seq-length": "16", "--num-microbatches": "1"}
EDGES = ["-1", "0", "1", "3", "7", str(2**40)]

# flag -> the Job field it sets (integer-valued flags)
INT_FLAGS = {"--micro-batch-size": "micro_batch_size", "--seq-length": "seq_length",
             "--num-microbatches": "num_microbatches", "--world-size": "world_size",
             "--tp": "tp", "--cp": "cp", "--ep": "ep", "--etp": "etp", "--pp": "pp",
             "--vpp": "vpp", "--zero": "zero", "--rounding": "rounding", "--seed": "seed",
             "--max-ep-classes": "max_ep_classes",
             "--pp-first-stage-layers": "pp_first_stage_layers",
             "--pp-last-stage-layers": "pp_last_stage_layers"}
TEXT_FLAGS = {"--routing": ("routing", ["", "hot:8:0", "zipf:-1", "balanced"]),
              "--hbm": ("hbm", ["0.1B", "-5GiB", "80GiB", "1e400GiB"])}


class Reached(Exception):
    pass


@pytest.fixture
def recorder(monkeypatch):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        raise Reached

    monkeypatch.setattr(tracemem.job, "Job", fake)
    return seen


def run_cli(flags: dict) -> None:
    argv = ["estimate", "--quiet"]
    for flag, value in (BASE | flags).items():
        argv.append(f"{flag}={value}")
    main(argv)


@pytest.mark.parametrize("flag", sorted(INT_FLAGS))
def test_every_parsable_int_reaches_the_api_unchanged(flag, recorder):
    for text in EDGES:
        recorder.clear()
        with pytest.raises(Reached):
            run_cli({flag: text})
        assert recorder[INT_FLAGS[flag]] == int(text), (flag, text)


@pytest.mark.parametrize("flag", sorted(TEXT_FLAGS))
def test_every_text_value_reaches_the_api_unchanged(flag, recorder):
    keyword, values = TEXT_FLAGS[flag]
    for text in values:
        recorder.clear()
        with pytest.raises(Reached):
            run_cli({flag: text})
        assert recorder[keyword] == text


def test_an_unparsable_int_is_rejected_by_both(recorder, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli({"--micro-batch-size": "x"})
    assert exit_info.value.code == 2 and not recorder
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


TINY = dict(world_size=1, micro_batch_size=1, seq_length=16, num_microbatches=1)


def test_rounding_0_is_exact_bytes_in_the_api_as_in_the_cli(capsys):
    api = estimate("deepseek-tiny", rounding=0, **TINY)
    assert api.settings["rounding"] == 0
    assert api.ranks[0].peak_bytes == estimate("deepseek-tiny", rounding=None, **TINY) \
        .ranks[0].peak_bytes
    assert main(["estimate", "--quiet", "--json", "--rounding", "0",
                 *[x for kv in BASE.items() for x in kv]]) == 0
    assert '"rounding": 0' in capsys.readouterr().out


@pytest.mark.parametrize("keyword, flag, value, message", [
    ("rounding", "--rounding", -1, r"--rounding -1 must be 0 \(exact bytes\) or a positive"),
    ("micro_batch_size", "--micro-batch-size", 0, r"--micro-batch-size 0 must be a positive"),
    ("seq_length", "--seq-length", -1, r"--seq-length -1 must be a positive integer"),
    ("num_microbatches", "--num-microbatches", 0, r"--num-microbatches 0 must be a positive"),
    ("max_ep_classes", "--max-ep-classes", 0, r"--max-ep-classes 0 must be a positive"),
    ("tp", "--tp", 0, r"--tp 0 must be a positive integer"),
    ("zero", "--zero", 4, r"--zero 4 is invalid; choose 0, 1, 2 or 3"),
])
def test_api_and_cli_reject_an_edge_value_with_the_same_message(keyword, flag, value, message,
                                                                 capsys):
    with pytest.raises(TracememError, match=message):
        estimate("deepseek-tiny", **(TINY | {keyword: value}))
    assert main(["estimate", "--quiet", *[x for kv in (BASE | {flag: str(value)}).items()
                                          for x in kv]]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_a_bool_is_not_a_count():
    with pytest.raises(TracememError, match=r"--micro-batch-size True must be a positive"):
        estimate("deepseek-tiny", **(TINY | {"micro_batch_size": True}))
