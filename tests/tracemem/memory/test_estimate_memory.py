"""The allocator inside ``tracemem estimate``: allocated / reserved peaks, fragmentation, the
--hbm judgement, --alloc-conf, --snapshot and --plot.

Reference: hand arithmetic on the two-stage toy of tests/tracemem/test_estimate_toy.py (its
tensor sizes are written out there) through the allocator's rules (docs/allocator.md), and
PyTorch's own ``torch.cuda._memory_viz`` on the written snapshots; the plot's lines are read
back from the figure and compared with the replay's series.
"""

import importlib.util
import json
import pickle
import re
from pathlib import Path

import pytest
from torch.cuda import _memory_viz

from tracemem.cli import main
from tracemem.estimator import estimate, replay_events
from tracemem.memory.plot import plot_timelines
from tracemem.memory.timeline import replay_through_allocator
from tracemem.report import format_estimate
from tracemem.schedules import schedule

# the toy's tracing, shared with tests/tracemem/test_estimate_toy.py
_spec = importlib.util.spec_from_file_location(
    "_estimate_toy", Path(__file__).parents[1] / "test_estimate_toy.py")
_toy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_toy)
trace_stage = _toy.trace_stage

MiB, GiB = 2**20, 2**30
TINY = dict(world_size=4, pp=2, micro_batch_size=1, seq_length=64, num_microbatches=4)
TINY_ARGS = ["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--pp", "2",
             "--micro-batch-size", "1", "--seq-length", "64", "--num-microbatches", "4"]


def test_toy_stages_through_the_allocator_match_hand_arithmetic():
    steps = schedule("1f1b", 2, 1, 4)
    # stage 0 at its peak (0B0) holds, for 2 microbatches, x and y (256 B each -> 512 B
    # blocks: 2 * 1024), plus dy (512) and the weight gradient (1024): 3,584 B allocated
    # (the tracer's 512 B rounding alone says 2,304). All are small requests: one 2 MiB
    # segment.
    stage0, _ = replay_through_allocator(replay_events(steps[0], 2, trace_stage(first=True)),
                                         steps[0], [], "stage 0")
    assert (stage0.stats.allocated_peak, stage0.stats.reserved_peak) == (3584, 2 * MiB)
    # stage 1, microbatch 1's backward: x (256), loss (4), loss gradient (4), the weight
    # gradient (1,024, accumulated) and the input gradient (256): 5 blocks of 512, 512, 512,
    # 1024, 512 = 3,072 B allocated; one 2 MiB segment, reached at the first event.
    stage1, _ = replay_through_allocator(replay_events(steps[1], 2, trace_stage(first=False)),
                                         steps[1], [], "stage 1")
    assert (stage1.stats.allocated_peak, stage1.stats.reserved_peak) == (3072, 2 * MiB)
    assert stage1.stats.reserved_peak_event == 0
    assert stage1.stats.fragmentation_bytes == 2 * MiB - 512
    # static memory goes first, one allocation per line item: 12 MiB of parameters get their
    # own 12 MiB segment; 1 MiB of buffers (= kSmallSize: small pool) a 2 MiB small segment,
    # split, whose free 1 MiB then holds all the toy's blocks: 12 + 2 = 14 MiB
    with_static, _ = replay_through_allocator(
        replay_events(steps[1], 2, trace_stage(first=False)), steps[1],
        [("parameter", 12 * MiB), ("buffer", MiB)], "stage 1")
    assert with_static.stats.reserved_peak == 14 * MiB
    assert with_static.stats.allocated_peak == 13 * MiB + 3072
    assert with_static.steps[0] == (2, "1F0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("estimate")
    result = estimate("deepseek-tiny", hbm="1GiB", non_pytorch_memory="1000MiB",
                      alloc_conf="expandable_segments:True", snapshot=str(out / "snaps"),
                      plot=str(out / "memory.png"), **TINY)
    return result, out


def test_estimate_reports_allocator_peaks_and_judges_reserved(tiny):
    result, _ = tiny
    for r in result.ranks:
        stats = r.memory.stats
        assert (r.allocated_peak_bytes, r.reserved_peak_bytes) == \
            (stats.allocated_peak, stats.reserved_peak)
        # whole blocks >= the tracer's 512-rounded bytes; segments >= blocks
        assert r.peak_bytes <= r.allocated_peak_bytes <= r.reserved_peak_bytes
        assert r.fragmentation_bytes == r.reserved_peak_bytes - stats.allocated_at_reserved_peak
        # 1 GiB - 1000 MiB = 24 MiB left for PyTorch: fits exactly when reserved <= 24 MiB
        assert r.fits == (r.reserved_peak_bytes + 1000 * MiB <= GiB)
    assert result.settings["alloc_conf"] == "expandable_segments:True"
    assert result.settings["non_pytorch_memory_bytes"] == 1000 * MiB


def test_estimate_writes_snapshots_pytorch_reads(tiny):
    result, out = tiny
    for r in result.ranks:
        with open(out / "snaps" / f"stage{r.pp_stage}.pickle", "rb") as f:
            data = pickle.load(f)
        summary = _memory_viz.segsum(data)
        # the snapshot is the allocator's state at the end of the step
        assert f"total_reserved: {_memory_viz.Bytes(r.memory.reserved[-1])}" in summary
        assert _memory_viz.trace_plot(data) and _memory_viz.segment_plot(data)
        assert _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
        frames = {f["filename"] for e in data["device_traces"][0] for f in e["frames"]}
        assert any(name.startswith("layers.") for name in frames)


def test_estimate_plot_series_equal_the_replay(tiny, tmp_path):
    result, out = tiny
    assert (out / "memory.png").stat().st_size > 1000
    fig = plot_timelines([r.memory for r in result.ranks], tmp_path / "again.svg",
                         hbm_bytes=GiB, units="MiB")
    for ax, r in zip(fig.axes, result.ranks):
        lines = {line.get_gid(): line for line in ax.get_lines()}
        assert list(lines["reserved"].get_ydata()) == [v / MiB for v in r.memory.reserved]
        assert list(lines["allocated"].get_ydata()) == [v / MiB for v in r.memory.allocated]
        # the stacked categories add up to the allocated series at every event
        totals = [sum(series[i] for series in r.memory.by_category.values())
                  for i in range(len(r.memory.allocated))]
        assert totals == list(r.memory.allocated)


def test_cli_json_and_table_carry_the_allocator(capsys):
    assert main(TINY_ARGS + ["--hbm", "80GiB", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["ranks"][0]
    assert row["reserved_peak_bytes"] >= row["allocated_peak_bytes"] >= row["peak_bytes"]
    assert row["fits"] is True and data["settings"]["non_pytorch_memory_bytes"] == 512 * MiB


def test_table_names_the_allocator_and_the_fit_rule(tiny):
    table = format_estimate(tiny[0])
    assert "reserved: max_memory_reserved" in table and "frag." in table
    assert "fits: reserved + 0.98 GiB non-PyTorch memory" in table


@pytest.mark.parametrize("extra, message", [
    (["--alloc-conf", "expandable_segment:True"], "unrecognized key 'expandable_segment'"),
    (["--plot", "memory.pdf"], r"\.png or \.svg"),
    (["--hbm", "1GiB", "--non-pytorch-memory", "2GiB"], "leaves nothing"),
    (["--non-pytorch-memory", "lots"], "--non-pytorch-memory 'lots' is invalid"),
])
def test_cli_allocator_flag_errors_are_one_line(capsys, extra, message):
    assert main(TINY_ARGS + extra) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
