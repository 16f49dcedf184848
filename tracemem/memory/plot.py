"""Memory over a training step, one panel per rank class, drawn with matplotlib.

Each panel: allocated memory stacked by category (whole allocator blocks, so the stack's top
is ``torch.cuda.memory_allocated``), the reserved line (``memory_reserved``), both peaks
annotated, the device memory (``--hbm``) and the part of it left to PyTorch after the
non-PyTorch allowance as horizontal lines, and the schedule's steps (``0F3``) on the x axis.
GiB = 2^30 bytes (MiB, KiB for small jobs).

Up to ``MAX_PANELS`` rank classes share one figure. More (a 16-stage job: one figure of 16
panels was 1320 x 5016 px) give an overview in the file named, one bar per rank class (its
allocated memory by category at its allocated peak, its reserved peak, the HBM lines), and
one detail figure per rank class beside it, ``detail_paths``: ``memory.png`` ->
``memory-stage-0.png``, ``memory-stage-1-ep-ranks-0-2.png``, ...

The "allocated peak" of a panel is the simulated ``torch.cuda.max_memory_allocated``: whole
blocks, so it is at least the estimate table's peak (the storages alive, each rounded to 512
B) by the unsplit remainders of blocks; "allocated then" is ``memory_allocated`` at the
reserved peak's event, which can be lower than the allocated peak (the reserved peak comes
when a request grows the cache, not when most is allocated).
"""

from __future__ import annotations

import re
from pathlib import Path

from tracemem.errors import TracememError
from tracemem.memory.timeline import MemoryTimeline

__all__ = ["plot_timelines", "check_plot_path", "detail_paths", "FORMATS", "MAX_PANELS"]

FORMATS = (".png", ".svg")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
_COLORS = {"parameter": "#4c72b0", "gradient": "#dd8452", "optimizer_state": "#55a868",
           "buffer": "#8c8c8c", "activation": "#c44e52", "comm_buffer": "#8172b3",
           "temporary": "#ccb974", "input": "#64b5cd", "zero3_gather": "#937860"}
_MAX_STEP_LABELS = 32
MAX_PANELS = 4  # rank classes drawn in one figure; more: an overview and one file each


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


def detail_paths(timelines: list[MemoryTimeline], path: str | Path) -> list[Path]:
    """The detail files ``plot_timelines`` writes beside ``path``, one per rank class, when
    there are more than ``MAX_PANELS`` (else none): ``path``'s stem, "-", the class's label
    in lower case with runs of other characters as "-" ("stage 1, EP ranks 0-2" ->
    ``stage-1-ep-ranks-0-2``), and ``path``'s suffix."""
    path = Path(path)
    if len(timelines) <= MAX_PANELS:
        return []
    return [path.with_name(f"{path.stem}-{re.sub(r'[^0-9a-z]+', '-', tl.label.lower()).strip('-')}"
                           f"{path.suffix}") for tl in timelines]


def plot_timelines(timelines: list[MemoryTimeline], path: str | Path, *,
                   hbm_bytes: int | None = None, usable_bytes: int | None = None,
                   title: str = "", units: str = "auto"):
    """Draw ``timelines`` and save to ``path`` (``.png`` or ``.svg``); return the matplotlib
    ``Figure`` saved there. Up to ``MAX_PANELS`` timelines: one panel each in that figure.
    More: that figure is the overview (``_overview``) and each timeline's panel is a figure
    of its own, saved to its ``detail_paths``; the returned figure's ``detail_figures`` are
    those (else empty). Panel artists carry gids: ``"allocated"`` and ``"reserved"`` lines
    (y in ``units``, x the event index), ``"category:<name>"`` stacked areas, ``"hbm"`` and
    ``"usable"`` lines. ``units``: GiB, MiB, KiB (binary) or auto (the largest in which the
    highest value drawn is >= 1).

    Raises:
        TracememError: another file extension, no timelines, or a file cannot be written.
    """
    path = check_plot_path(path)
    if not timelines:
        raise TracememError("--plot: nothing to draw (no rank classes)")
    from matplotlib.figure import Figure  # lazily: matplotlib imports in ~0.5 s

    if units == "auto":
        top = max([hbm_bytes or 0] + [max(tl.reserved, default=0) for tl in timelines])
        units = next((u for u, n in _UNITS.items() if top >= n), "KiB")
    if units not in _UNITS:
        raise TracememError(f"plot units {units!r}: choose one of {', '.join(_UNITS)} or auto")
    details = detail_paths(timelines, path)
    figures = []
    if details:
        fig = Figure(figsize=(12, 0.32 * len(timelines) + 1.8), layout="constrained")
        _overview(fig.subplots(), timelines, hbm_bytes, usable_bytes, units)
        for tl, detail in zip(timelines, details):
            one = Figure(figsize=(12, 3.6), layout="constrained")
            _panel(one.subplots(), tl, hbm_bytes, usable_bytes, units)
            if title:
                one.suptitle(title, fontsize=10)
            figures.append((one, detail))
    else:
        fig = Figure(figsize=(12, 2.8 * len(timelines) + 0.8), layout="constrained")
        axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
        for ax, tl in zip(axes, timelines):
            _panel(ax, tl, hbm_bytes, usable_bytes, units)
    if title:
        fig.suptitle(title + (f"; one file per rank class: {details[0].name}, ..."
                              if details else ""), fontsize=10)
    for figure, where in [(fig, path)] + figures:
        try:
            figure.savefig(where, dpi=110)
        except OSError as e:
            raise TracememError(f"--plot: cannot write {str(where)!r}: {e.strerror}") from None
    fig.detail_figures = [figure for figure, _ in figures]
    return fig


def _overview(ax, timelines: list[MemoryTimeline], hbm_bytes, usable_bytes, units) -> None:
    """One horizontal bar per rank class, top to bottom: its allocated memory by category at
    its allocated peak (the first event where ``allocated`` is highest), stacked, and its
    reserved peak as a tick; the HBM lines vertical. Gids: ``"category:<name>"`` bar groups,
    ``"reserved"`` markers, ``"hbm"`` / ``"usable"``."""
    unit = _UNITS[units]
    at = [max(range(len(tl.allocated)), key=tl.allocated.__getitem__) if len(tl.allocated)
          else None for tl in timelines]
    names = [n for n in _COLORS if any(n in tl.by_category for tl in timelines)]
    names += sorted({n for tl in timelines for n in tl.by_category} - set(names))
    y = list(range(len(timelines)))
    left = [0.0] * len(timelines)
    for name in names:
        widths = [(tl.by_category[name][i] / unit if name in tl.by_category and i is not None
                   else 0.0) for tl, i in zip(timelines, at)]
        if not any(widths):
            continue
        ax.barh(y, widths, left=left, color=_COLORS.get(name, "#b0b0b0"), height=0.7,
                label=name.replace("_", " "), gid=f"category:{name}")
        left = [a + b for a, b in zip(left, widths)]
    reserved = [tl.stats.reserved_peak / unit for tl in timelines]
    ax.plot(reserved, y, linestyle="none", marker="|", markersize=14, color="#d62728",
            markeredgewidth=2, label="reserved peak", gid="reserved")
    for i, (tl, r) in enumerate(zip(timelines, reserved)):
        ax.annotate(f"{tl.stats.allocated_peak / unit:.2f} / {r:.2f}", (r, i),
                    xytext=(6, 0), textcoords="offset points", va="center", fontsize=7)
    top = max(reserved, default=0)
    for value, gid, style, text in ((hbm_bytes, "hbm", "-", "HBM"),
                                    (usable_bytes, "usable", "--",
                                     "HBM less non-PyTorch memory")):
        if value is not None:
            ax.axvline(value / unit, color="#444444", linestyle=style, linewidth=0.9,
                       gid=gid, label=f"{text} {value / unit:.2f} {units}")
            top = max(top, value / unit)
    ax.set_xlim(0, top * 1.15 if top else 1)
    ax.set_yticks(y, [tl.label for tl in timelines], fontsize=8)
    ax.invert_yaxis()  # the first rank class on top
    ax.set_xlabel(f"{units}: allocated by category at each rank class's allocated peak "
                  f"(max_memory_allocated, whole blocks); labels: allocated peak / reserved "
                  f"peak", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, ncol=1)


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
                    f"(allocated then {stats.allocated_at_reserved_peak / unit:.2f}, largest "
                    f"free block {stats.largest_free_block / unit:.2f})",
                    xy=(at, stats.reserved_peak / unit), xytext=(0.01, 0.97),
                    textcoords="axes fraction", va="top", fontsize=8,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "none", "alpha": 0.85},
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
    ax.set_title(f"{tl.label}: allocated peak {stats.allocated_peak / unit:.2f} {units} "
                 f"(max_memory_allocated: whole blocks, at least the table's peak), reserved "
                 f"peak {stats.reserved_peak / unit:.2f} {units}", fontsize=9, loc="left")
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
