"""The per-event timeline of a replay and its matplotlib plot.

Reference: the simulator's own series (``AllocatorStats.allocated`` / ``reserved``) and hand
arithmetic from the allocator's rules (docs/allocator.md) for a four-event replay; the plot's
lines are read back from the matplotlib Figure by gid.
"""

import pytest

from tracemem.errors import TracememError
from tracemem.memory.plot import plot_timelines
from tracemem.memory.timeline import AllocatorReplay

MiB, GiB = 2**20, 2**30


def replay():
    # step "0F0": w = 12 MiB parameter (own 12 MiB segment), x = 3 MiB activation (20 MiB
    # segment, split: [x 3][free 17]); step "0B0": g = 1000 B gradient (2 MiB small segment,
    # 1024 B block), free x.
    r = AllocatorReplay()
    r.step("0F0")
    r.alloc("w", 12 * MiB, "parameter", "layers.0", "static")
    r.alloc("x", 3 * MiB, "activation", "layers.0.mlp", "aten.mm.default")
    r.step("0B0")
    r.alloc("g", 1000, "gradient", "layers.0.mlp", "aten.mm.default")
    r.free("x")
    return r.timeline("stage 0")


def test_timeline_series_by_category():
    tl = replay()
    assert list(tl.allocated) == [12 * MiB, 15 * MiB, 15 * MiB + 1024, 12 * MiB + 1024]
    assert list(tl.reserved) == [12 * MiB, 32 * MiB, 34 * MiB, 34 * MiB]
    assert {k: list(v) for k, v in tl.by_category.items()} == {
        "parameter": [12 * MiB] * 4, "activation": [0, 3 * MiB, 3 * MiB, 0],
        "gradient": [0, 0, 1024, 1024]}
    assert tl.steps == [(0, "0F0"), (2, "0B0")]


def test_resized_storage_keeps_the_old_block_until_its_free():
    # the tracer reports resize_ as: alloc of the new size, then free of the old storage
    r = AllocatorReplay()
    r.alloc("s", 4 * MiB, "temporary")
    r.alloc("s", 6 * MiB, "temporary")   # both live: 4 + 6 MiB in the 20 MiB segment
    assert r.sim.allocated_bytes == 10 * MiB
    r.free("s")                           # frees the old 4 MiB block
    assert r.sim.allocated_bytes == 6 * MiB
    r.free("s")
    assert r.sim.allocated_bytes == 0 and list(r.timeline("t").by_category["temporary"]) == \
        [4 * MiB, 10 * MiB, 6 * MiB, 0]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_is_written_and_its_series_equal_the_replay(tmp_path, suffix):
    tl = replay()
    path = tmp_path / f"memory{suffix}"
    fig = plot_timelines([tl, tl], path, hbm_bytes=80 * GiB, usable_bytes=79 * GiB,
                         units="GiB")
    assert path.stat().st_size > 1000
    ax = fig.axes[0]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    assert list(lines["allocated"].get_ydata()) == [v / GiB for v in tl.allocated]
    assert list(lines["reserved"].get_ydata()) == [v / GiB for v in tl.reserved]
    assert list(lines["hbm"].get_ydata()) == [80, 80]
    assert {c.get_gid() for c in ax.collections} == \
        {"category:parameter", "category:activation", "category:gradient"}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0F0", "0B0"]
    assert "reserved peak 0.03 GiB" in " ".join(t.get_text() for t in ax.texts)
    if suffix == ".svg":
        assert path.read_text().lstrip().startswith("<?xml")


def test_plot_rejects_other_formats(tmp_path):
    with pytest.raises(TracememError, match=r"\.png or \.svg"):
        plot_timelines([replay()], tmp_path / "memory.pdf")
