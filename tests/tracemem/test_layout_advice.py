"""Every layout error's advice is actionable: the flags it suggests are accepted by the validator
(issue 16 item 6: under --vpp 2 the advice named --pp-first-stage-layers /
--pp-last-stage-layers, which the next run rejected).

Reference: the validator itself (``ParallelConfig.create`` through the CLI's own parser), and
Megatron-Core's uneven split (``get_num_layers_to_build``: the given ends, the other stages
share the rest evenly) for the hand-checked layouts.
"""

import json
import re
from pathlib import Path

import pytest

import modeling
from modeling import load_config
from tracemem.cli import build_parser, main, parallel_config_from_args
from tracemem.errors import TracememError
from tracemem.parallel import format_layout, suggest_ends, suggest_layout

V3 = load_config("deepseek-v3")  # 61 decoder layers
BASE = ["static", "--model", "deepseek-v3", "--world-size", "1024", "--tp", "2", "--ep", "8"]
LAYOUT_FLAGS = ("--pp-layout", "--pp-first-stage-layers", "--pp-last-stage-layers")


def _config(flags):
    return parallel_config_from_args(build_parser().parse_args(BASE + flags), V3)


def _without_layout(flags):
    out, i = [], 0
    while i < len(flags):
        if flags[i] in LAYOUT_FLAGS:
            i += 2
        else:
            out.append(flags[i])
            i += 1
    return out


def _suggestions(message):
    """Every set of layout flags the message suggests, as argv lists."""
    found = [["--pp-layout", m] for m in re.findall(r"--pp-layout (?:\(e\.g\. )?([0-9*,]+)",
                                                     message)]
    found += [["--pp-first-stage-layers", a, "--pp-last-stage-layers", b] for a, b in re.findall(
        r"--pp-first-stage-layers ([0-9]+) --pp-last-stage-layers ([0-9]+)", message)]
    return found


@pytest.mark.parametrize("flags, message", [
    (["--pp", "16"], "61 layers do not divide into pp * vpp = 16 stages; give --pp-layout "
                     "(e.g. 4*15,1) or --pp-first-stage-layers / --pp-last-stage-layers (e.g. "
                     "--pp-first-stage-layers 4 --pp-last-stage-layers 1)"),
    # the case: under VPP the advice names only --pp-layout, and says why
    (["--pp", "16", "--vpp", "2"],
     "61 layers do not divide into pp * vpp = 32 stages; give --pp-layout (e.g. 2*29,1*3) "
     "(--pp-first-stage-layers / --pp-last-stage-layers do not apply with --vpp > 1)"),
    (["--pp", "16", "--vpp", "2", "--pp-first-stage-layers", "4", "--pp-last-stage-layers", "1"],
     "--pp-first-stage-layers / --pp-last-stage-layers with --vpp > 1 are not supported; give "
     "--pp-layout with one entry per virtual stage instead, e.g. --pp-layout 4,2*26,1*5"),
    (["--pp", "16", "--vpp", "2", "--pp-first-stage-layers", "1"],
     "--pp-first-stage-layers with --vpp > 1 is not supported; give --pp-layout with one entry "
     "per virtual stage instead, e.g. --pp-layout 1,2*29,1*2"),
    (["--pp", "16", "--pp-first-stage-layers", "5", "--pp-last-stage-layers", "1"],
     "--pp-first-stage-layers 5 and --pp-last-stage-layers 1 leave 55 layers for 14 other "
     "stages, which do not divide evenly; try --pp-first-stage-layers 4 --pp-last-stage-layers "
     "1 or --pp-layout 5,4*13,3,1"),
    (["--pp", "16", "--pp-first-stage-layers", "5"],
     "--pp-first-stage-layers 5 leaves 56 layers for 15 other stages, which do not divide "
     "evenly; try --pp-first-stage-layers 5 --pp-last-stage-layers 0 or --pp-layout 5,4*11,3*4"),
    (["--pp", "16", "--pp-last-stage-layers", "5"],
     "--pp-last-stage-layers 5 leaves 56 layers for 15 other stages, which do not divide "
     "evenly; try --pp-first-stage-layers 0 --pp-last-stage-layers 5 or --pp-layout "
     "4*11,3*4,5"),
    (["--pp", "2", "--pp-first-stage-layers", "61", "--pp-last-stage-layers", "2"],
     "--pp-first-stage-layers 61 and --pp-last-stage-layers 2 add up to more than the model's "
     "61 layers; try --pp-first-stage-layers 59 --pp-last-stage-layers 2 or --pp-layout 31,30"),
    (["--pp", "2", "--pp-first-stage-layers", "30", "--pp-last-stage-layers", "30"],
     "--pp-first-stage-layers 30 and --pp-last-stage-layers 30 leave 1 layer on no stage; try "
     "--pp-first-stage-layers 31 --pp-last-stage-layers 30 or --pp-layout 31,30"),
    (["--pp", "16", "--pp-first-stage-layers", "100"],
     "--pp-first-stage-layers 100 must be between 0 and the model's 61 layers; e.g. "
     "--pp-first-stage-layers 4 --pp-last-stage-layers 1"),
    (["--pp", "16", "--pp-layout", "4*15"],
     "--pp-layout has 15 entries; it needs one per virtual pipeline stage, pp * vpp = 16; try "
     "--pp-layout 4*15,1 or --pp-first-stage-layers 4 --pp-last-stage-layers 1"),
    (["--pp", "16", "--pp-layout", "4*16"],
     "--pp-layout sums to 64 layers; the model has 61; try --pp-layout 4*15,1 or "
     "--pp-first-stage-layers 4 --pp-last-stage-layers 1"),
    (["--pp", "16", "--vpp", "2", "--pp-layout", "4*15,1"],
     "--pp-layout has 16 entries; it needs one per virtual pipeline stage, pp * vpp = 32; try "
     "--pp-layout 2*29,1*3"),
    (["--pp", "32"], "61 layers do not divide into pp * vpp = 32 stages; "
                     "give --pp-layout (e.g. 2*29,1*3) or --pp-first-stage-layers / "
                     "--pp-last-stage-layers (e.g. --pp-first-stage-layers 1 "
                     "--pp-last-stage-layers 0)"),
])
def test_each_suggested_layout_is_accepted(flags, message):
    with pytest.raises(TracememError) as error:
        _config(flags)
    assert str(error.value) == message
    suggestions = _suggestions(message)
    assert suggestions
    for suggestion in suggestions:
        par = _config(_without_layout(flags) + suggestion)
        assert sum(par.pp_layout) == 61 and len(par.pp_layout) == par.pp * par.vpp


@pytest.mark.parametrize("flags, message, fix", [
    (["--pp", "1", "--pp-first-stage-layers", "3"],
     "--pp-first-stage-layers / --pp-last-stage-layers need --pp 2 or more; drop them (one "
     "stage holds every layer) or raise --pp", ["--pp", "1"]),
    (["--pp", "64"], "pp * vpp = 64 stages is more than the model's 61 layers; lower --pp or "
                     "--vpp so that pp * vpp <= 61", ["--pp", "1"]),
    (["--pp", "16", "--pp-layout", "4*15,1", "--pp-first-stage-layers", "4"],
     "give either --pp-layout or --pp-first-stage-layers / --pp-last-stage-layers, not both",
     ["--pp", "16", "--pp-layout", "4*15,1"]),
])
def test_advice_in_words_is_accepted_too(flags, message, fix):
    with pytest.raises(TracememError, match=re.escape(message)):
        _config(flags)
    assert _config(fix).pp_layout


def test_suggestions_by_hand():
    # 61 = 4 * 15 + 1 (DeepSeek-V3's own layout); middle stages of ceil(61 / 16) = 4 leave 5
    # for the ends: 4 and 1
    assert suggest_ends(61, 16) == (4, 1)
    assert format_layout(suggest_layout(61, 16)) == "4*15,1"
    # 32 virtual stages: 2 * 30 = 60 leaves one stage of 1 and one of 0, so an even split
    # instead: 29 stages of 2 and 3 of 1 (58 + 3 = 61)
    assert suggest_layout(61, 32) == (2,) * 29 + (1,) * 3
    # ends kept: 61 - 4 - 1 = 56 over 30 stages: 26 of 2 and 4 of 1
    assert suggest_layout(61, 32, 4, 1) == (4,) + (2,) * 26 + (1,) * 4 + (1,)
    assert format_layout((0, 0, 3)) == "0*2,3"


def test_the_vpp_advice_runs_end_to_end(tmp_path, capsys):
    """The issue's sequence on a 5-layer model: --vpp 2 with first / last stage layers is
    rejected, and the --pp-layout it suggests runs."""
    preset = (Path(modeling.__file__).parent / "families" / "deepseek" / "presets"
              / "deepseek-tiny.json")
    config = json.loads(preset.read_text())
    config["num_hidden_layers"] = 5
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["estimate", "--model", str(path), "--world-size", "2", "--pp", "2", "--vpp", "2",
            "--schedule", "interleaved-1f1b", "--micro-batch-size", "1", "--seq-length", "16",
            "--num-microbatches", "2", "--experts", "sequential", "--quiet"]
    assert main(argv + ["--pp-first-stage-layers", "2", "--pp-last-stage-layers", "1"]) == 2
    err = capsys.readouterr().err
    (suggestion,) = _suggestions(err)
    assert suggestion == ["--pp-layout", "2,1*3"]  # ends kept: 5 - 2 - 1 = 2 over 2 stages
    assert main(argv + suggestion + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parallel"]["pp_layout"] == [2, 1, 1, 1]
