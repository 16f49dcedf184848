"""Inputs validated where they enter (issue 9 item 8): unknown keywords, unreadable config
files. Reference: the messages the issue asks for (one line, naming the fault)."""

import pytest

from modeling import load_config
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig


def test_create_with_an_unknown_keyword_lists_the_valid_ones():
    cfg = load_config("deepseek-tiny")
    with pytest.raises(TracememError, match=r"unknown keyword 'bogus'; valid: world_size, tp, "
                       r"sp, cp, ep, etp, pp, vpp, zero, precision, plan, .*pp_layout"):
        ParallelConfig.create(cfg, world_size=1, bogus=1)


@pytest.mark.parametrize("content, message", [
    ('{"hidden_size": ' + "9" * 5000 + "}", r"unreadable JSON: Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, r"unreadable JSON: nested too deeply"),
])
def test_config_files_that_json_cannot_hold_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(TracememError, match=message) as info:
        load_config(str(path))
    assert "\n" not in str(info.value)


TINY = dict(world_size=1, micro_batch_size=1, seq_length=16, num_microbatches=1)


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_length=2**40), r"--seq-length 1099511627776 = 1,099,511,627,776 tokens per "
                             r"microbatch is more than 2\^32"),
    (dict(num_microbatches=2**63), r"--num-microbatches 9223372036854775808 is more than 2\^12"),
])
def test_sizes_beyond_any_machine_are_one_line_errors(overrides, message):
    from tracemem.estimator import estimate

    with pytest.raises(TracememError, match=message):
        estimate("deepseek-tiny", **(TINY | overrides))
