"""Memory over a training step, one panel per rank class, drawn with matplotlib.

Each panel: allocated memory stacked by category (whole allocator blocks, so the stack's top
is ``torch.cuda.memory_allocated``), the reserved line (``memory_reserved``), both peaks
annotated, the device memory (``--hbm``) and the part of it left to PyTorch after the
non-PyTorch allowance as horizontal lines, and the schedule's steps (``0F3``) on the x axis.
GiB = 2^30 bytes (MiB, KiB for small jobs).
"""

from __future__ import annotations

from pathlib import Path

from tracemem.errors import TracememError
from tracemem.memory.timeline import MemoryTimeline

__all__ = ["plot_timelines", "check_plot_path", "FORMATS"]

FORMATS = (".png", ".svg")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
_COLORS = {"parameter": "#4c72b0", "gradient": "#dd8452", "optimizer_state": "#55a868",
           "buffer": "#8c8c8c", "activation": "#c44e52", "comm_buffer": "#8172b3",
           "temporary": "#ccb974", "input": "#64b5cd", "zero3_gather": "#937860"}
_MAX_STEP_LABELS = 32


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a Path, if it names a .png or .svg file in an existing directory.

    Raises:
        TracememError: another extension, or no such directory.
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise TracememError(f"--plot {str(path)!r}: give a file ending in .png or .svg")
    if not path.parent.is_dir():
        raise TracememError(f"--plot {str(path)!r}: directory {str(path.parent)!r} does not "
                            f"exist")
    return path


def plot_timelines(timelines: list[MemoryTimeline], path: str | Path, *,
                   hbm_bytes: int | None = None, usable_bytes: int | None = None,
                   title: str = "", units: str = "auto"):
    """Draw ``timelines`` and save to ``path`` (``.png`` or ``.svg``); return the matplotlib
    ``Figure``. Artists carry gids: ``"allocated"`` and ``"reserved"`` lines (y in ``units``,
    x the event index), ``"category:<name>"`` stacked areas, ``"hbm"`` and ``"usable"``
    lines. ``units``: GiB, MiB, KiB (binary) or auto (the largest in which the highest value
    drawn is >= 1).

    Raises:
        TracememError: another file extension, no timelines, or the file cannot be written.
    """
    path = check_plot_path(path)
    if not timelines:
        raise TracememError("--plot: nothing to draw (no rank classes)")
    from matplotlib.figure import Figure  # lazily: matplotlib imports in ~0.5 s

    fig = Figure(figsize=(12, 2.8 * len(timelines) + 0.8), layout="constrained")
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    if units == "auto":
        top = max([hbm_bytes or 0] + [max(tl.reserved, default=0) for tl in timelines])
        units = next((u for u, n in _UNITS.items() if top >= n), "KiB")
    if units not in _UNITS:
        raise TracememError(f"plot units {units!r}: choose one of {', '.join(_UNITS)} or auto")
    for ax, tl in zip(axes, timelines):
        _panel(ax, tl, hbm_bytes, usable_bytes, units)
    if title:
        fig.suptitle(title, fontsize=10)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise TracememError(f"--plot: cannot write {str(path)!r}: {e.strerror}") from None
    return fig


def _panel(ax, tl: MemoryTimeline, hbm_bytes, usable_bytes, units) -> None:
    unit = _UNITS[units]
    x = range(len(tl.allocated))
    names = [n for n in _COLORS if n in tl.by_category] + \
        sorted(n for n in tl.by_category if n not in _COLORS)
    names = [n for n in names if max(tl.by_category[n], default=0) > 0]
    ys = [[v / unit for v in tl.by_category[n]] for n in names]
    if ys:
        areas = ax.stackplot(x, *ys, labels=[n.replace("_", " ") for n in names],
                             colors=[_COLORS.get(n, "#b0b0b0") for n in names],
                             alpha=0.85, linewidth=0, step="post")
        for area, name in zip(areas, names):
            area.set_gid(f"category:{name}")
    allocated = [v / unit for v in tl.allocated]
    reserved = [v / unit for v in tl.reserved]
    # memory holds its value until the next event: step lines
    ax.plot(x, allocated, color="black", linewidth=0.8, label="allocated",
            gid="allocated", drawstyle="steps-post")
    ax.plot(x, reserved, color="#d62728", linewidth=1.2, label="reserved", gid="reserved",
            drawstyle="steps-post")
    stats = tl.stats
    if stats.reserved_peak_event is not None:
        at = stats.reserved_peak_event
        ax.annotate(f"reserved peak {stats.reserved_peak / unit:.2f} {units}\n"
                    f"(allocated {stats.allocated_at_reserved_peak / unit:.2f}, largest free "
                    f"block {stats.largest_free_block / unit:.2f})",
                    xy=(at, stats.reserved_peak / unit), xytext=(0.01, 0.97),
                    textcoords="axes fraction", va="top", fontsize=8,
                    arrowprops={"arrowstyle": "->", "color": "#d62728", "lw": 0.8})
    top = max(reserved, default=0)
    for value, gid, style, text in ((hbm_bytes, "hbm", "-", "HBM"),
                                    (usable_bytes, "usable", "--",
                                     "HBM less non-PyTorch memory")):
        if value is not None:
            ax.axhline(value / unit, color="#444444", linestyle=style, linewidth=0.9,
                       gid=gid, label=f"{text} {value / unit:.2f} {units}")
            top = max(top, value / unit)
    ax.set_ylim(0, top * 1.12 if top else 1)
    ax.set_xlim(0, max(len(allocated) - 1, 1))
    ax.set_ylabel(units)
    ax.set_title(f"{tl.label}: allocated peak {stats.allocated_peak / unit:.2f} {units}, "
                 f"reserved peak {stats.reserved_peak / unit:.2f} {units}", fontsize=9,
                 loc="left")
    if tl.steps:
        positions = [i for i, _ in tl.steps]
        ax.set_xticks(positions, minor=True)
        stride = max(1, -(-len(tl.steps) // _MAX_STEP_LABELS))
        shown = tl.steps[::stride]
        ax.set_xticks([i for i, _ in shown], [label for _, label in shown], rotation=90,
                      fontsize=7)
        ax.set_xlabel("schedule step (stage / F or B / microbatch); every replayed alloc or "
                      "free is one x unit", fontsize=8)
    else:
        ax.set_xlabel("event", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, ncol=1)
