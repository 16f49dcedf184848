"""Snapshots of the simulated allocator, read back by PyTorch's own tools.

Reference: torch 2.13's ``torch.cuda._memory_viz`` (``segsum``, ``trace``, ``segments``,
``memory``, ``segment_plot``, ``trace_plot``), run on the pickled file; expected segment
counts and bytes are the simulator's, derived by hand in the comments (rules in
docs/allocator.md). ``segments`` / ``memory`` are given a ``format_flamegraph`` that returns
its input lines, because the default one downloads flamegraph.pl from the internet.
"""

import base64
import pickle
import re

import pytest
from torch.cuda import _memory_viz

from tracemem.errors import TracememError
from tracemem.memory import CachingAllocatorSimulator
from tracemem.memory.snapshot import to_snapshot, write_snapshot

MiB = 2**20
INFO = {"module": "layers.0.mlp", "op": "aten.mm.default", "category": "activation"}


def simulated(conf=None):
    # a = 3 MiB: 20 MiB segment, split -> [a 3][free 17]; b = 1000 B: 2 MiB small segment ->
    # [b 1024 B][free]; c = 12 MiB: best fit is the free 17 MiB -> [a 3][c 12][free 5]; free a
    # -> [free 3][c 12][free 5]. 2 segments, 22 MiB reserved, 5 blocks; alive b (1024 B block,
    # 1000 B requested) and c (12 MiB)
    sim = CachingAllocatorSimulator(conf, record_history=True)
    sim.malloc("a", 3 * MiB, INFO)
    sim.malloc("b", 1000, {"module": "", "op": "aten.empty.memory_format",
                           "category": "temporary"})
    sim.malloc("c", 12 * MiB, INFO)
    sim.free("a")
    return sim


def test_snapshot_loads_in_memory_viz_tools(tmp_path):
    path = write_snapshot(simulated(), tmp_path / "stage0.pickle")
    with open(path, "rb") as f:
        data = pickle.load(f)
    summary = _memory_viz.segsum(data)  # raises on any size mismatch inside a segment
    assert "segments: 2" in summary
    assert "total_reserved: 22.0MiB" in summary
    assert "total_allocated: 12.0MiB" in summary  # requested bytes: 12 MiB + 1000 B
    trace = _memory_viz.trace(data)
    # segment_alloc, alloc a, segment_alloc, alloc b, alloc c, free_requested a,
    # free_completed a
    assert trace.count("cudaMalloc(") == 2 and "7 entries" in trace
    lines = _memory_viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "stream_0;active_allocated;layers.0.mlp:0:aten.mm.default 12582912" in lines
    segs = _memory_viz.segments(data, format_flamegraph=lambda lines: lines)
    # every byte of the 2 segments is accounted for, in 5 blocks (2 of them allocated)
    assert len(set(re.findall(r"seg_\d+", segs))) == 2
    assert sum(int(line.rsplit(" ", 1)[1]) for line in segs.splitlines()) == 22 * MiB
    # b's block is 1024 B for 1000 B requested: its 24 B show as <gaps>
    assert [line for line in segs.splitlines() if ";active_allocated;" in line][-1] == \
        f"stream_0;seg_{data['segments'][-1]['address']};active_allocated;<gaps> 24"
    for html in (_memory_viz.segment_plot(data), _memory_viz.trace_plot(data)):
        encoded = re.search(r'"base64": "([^"]+)"', html).group(1)
        assert pickle.loads(base64.b64decode(encoded).rstrip(b"\x00")) == data


def test_snapshot_trace_entries_and_categories():
    data = to_snapshot(simulated())
    actions = [e["action"] for e in data["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "segment_alloc", "alloc", "alloc",
                       "free_requested", "free_completed"]
    categories = {e["category"] for e in data["device_traces"][0]}
    assert categories == {"unknown", "activation", "temporary"}
    alloc_a = data["device_traces"][0][1]
    assert (alloc_a["size"], alloc_a["frames"]) == (
        3 * MiB, [{"filename": "layers.0.mlp", "line": 0, "name": "aten.mm.default"}])


def test_expandable_snapshot_reports_mapped_ranges():
    # expandable: a (3 MiB) maps one 20 MiB page of a large-pool segment, b one 2 MiB page of
    # a small-pool one (made later, so at a higher address), c (12 MiB) fits the free 17 MiB
    # after a: 2 mapped ranges, 22 MiB reserved
    data = to_snapshot(simulated("expandable_segments:True"))
    assert [(s["total_size"], s["segment_type"], s["is_expandable"])
            for s in data["segments"]] == [(20 * MiB, "large", True), (2 * MiB, "small", True)]
    assert "total_reserved: 22.0MiB" in _memory_viz.segsum(data)
    assert [e["action"] for e in data["device_traces"][0]].count("segment_map") == 2


def test_snapshot_needs_history():
    with pytest.raises(TracememError, match="record_history=True"):
        to_snapshot(CachingAllocatorSimulator())
