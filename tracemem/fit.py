"""``tracemem fit``: every valid layout of a model on ``world_size`` GPUs, each estimated, those
that fit in ``hbm`` ranked by a stated cost model (``tracemem.formulas.cost``).

Enumeration (``enumerate_layouts``): the product of the search space's dimensions (TP, SP, CP,
EP, ETP, PP with its layer layouts, VPP, micro-batch size b, recompute, ZeRO stage, schedule);
the number of microbatches follows from the global batch, M = G / (b x DP), which must be an
integer (Megatron-LM ``megatron/core/num_microbatches_calculator.py``,
``ConstantNumMicroBatchesCalculator``: "global batch size ... is not divisible by micro batch
size times data parallel size"). A candidate is valid when ``ParallelConfig.create`` accepts
it (the degrees against the world size and the model: Megatron-LM ``megatron/training/
arguments.py`` ``validate_args`` and ``megatron/core/parallel_state.py``
``initialize_model_parallel``, cited there) and ``tracemem.estimator.check_job`` accepts the job
(SP with TP and EP, s divisible by CP x SP, the schedule's own rules); nothing else decides.

PP layer layouts (``pp_layouts``): an even split when pp x vpp divides the layers; else
Megatron's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
(tracemem's ``--pp-first-stage-layers`` / ``--pp-last-stage-layers``), whose rules are
Megatron-Core's ``TransformerConfig.__post_init__`` (megatron/core/transformer/
transformer_config.py, "Uneven PP"): each given end holds at least one layer, the middle stages
share the rest evenly (none left when there are no middle stages), and with VPP the ends and
each middle rank's layers divide by vpp (then each rank's chunks split its layers evenly).
Which of those layouts are tried is ``--pp-ends``: ``suggested`` (default: the even split if
there is one, else the balanced layout with the fewest layers on the last stage, which also
holds the head, loss and MTP: 4 and 1 for 61 layers on 16 stages, DeepSeek-V3's), ``balanced``
(every layout whose ends hold no more layers than a middle stage) or ``all``.

Estimation: each layout through ``tracemem.estimator.estimate`` with one ``TraceCache`` per
worker process (a rank class's trace is made once per run, and optionally kept on disk), first
screened (``estimate(screen=True)``: a layout whose replayed peak alone is over ``hbm`` does not
fit, so the allocator simulation is skipped), then the closest layouts that do not fit are
estimated in full to say by how much. Layouts that share a trace family (all but the ZeRO
stage, schedule and M) go to the same worker. Engines: ``local`` (``concurrent.futures``
worker processes, or in this process with one worker) and ``ray`` (tasks on a Ray cluster).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tracemem.errors import TracememError

__all__ = ["SearchSpace", "Layout", "FitRow", "FitResult", "pp_layouts", "enumerate_layouts",
           "fit", "PP_ENDS", "ENGINES", "DEFAULT_CLOSEST"]

PP_ENDS = ("suggested", "balanced", "all")
_DERIVED = ("tp", "ep", "pp", "zero")  # SearchSpace dimensions with a derived default
ENGINES = ("local", "ray")
DEFAULT_CLOSEST = 5  # layouts that do not fit, estimated in full to say by how much
RECOMPUTES = ("none", "selective", "full")


# The most candidates (the product of the dimensions' values) a derived default space holds
# (``SearchSpace.resolve``): a bound on fit's run time, as each (TP, EP, PP, recompute,
# ZeRO-3) family is traced once. 384: Llama-3-70B on 64 GPUs holds 144, DeepSeek-V3 on 2,048
# GPUs is thinned to 384 (EP 32-256, PP 2-16).
MAX_DEFAULT_CANDIDATES = 384
DEFAULT_RANKS_PER_NODE = 8  # GPUs per node of a DGX / HGX H100 or B200 system


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(max(limit, 1).bit_length()) if 2**i <= limit]


@dataclass(frozen=True)
class SearchSpace:
    """The values tried per dimension (each a tuple; None: derived from the model and the world
    size by ``resolve``). ``sp``: True, False or both; SP applies where TP > 1 (TP 1 runs
    without).

    Derived defaults (``resolve``), powers of two that the model and the world size allow:
    TP within a node (<= ranks per node) dividing the attention heads and the key / value
    heads; PP up to half the layers (at least two per stage); EP dividing the routed experts
    (1 for a dense model); no CP, VPP or ETP; b = 1; every recompute mode; ZeRO-1 (Megatron's
    distributed optimizer) and ZeRO-3 (FSDP); 1F1B. Past ``MAX_DEFAULT_CANDIDATES`` the
    longer of the EP and PP lists loses its smallest value (the least sharded, the first not
    to fit a large model) until the space is within the bound; the given dimensions are never
    thinned."""

    tp: tuple[int, ...] | None = None
    sp: tuple[bool, ...] = (True,)
    cp: tuple[int, ...] = (1,)
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] = (1,)
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] = (1,)
    pp_ends: str = "suggested"
    micro_batch_size: tuple[int, ...] = (1,)
    recompute: tuple[str, ...] = RECOMPUTES
    zero: tuple[int, ...] | None = None
    schedule: tuple[str, ...] = ("1f1b",)

    def resolve(self, cfg, world_size: int,
                ranks_per_node: int = DEFAULT_RANKS_PER_NODE) -> SearchSpace:
        """This space with every None dimension derived (the class docstring) for model
        ``cfg`` (a ``ModelConfig``) on ``world_size`` GPUs of ``ranks_per_node`` per node."""
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        derived: dict[str, tuple] = {}
        if self.tp is None:
            derived["tp"] = tuple(t for t in _powers_of_two(min(ranks_per_node, world_size))
                                  if heads % t == 0 and kv % t == 0) or (1,)
        if self.pp is None:
            derived["pp"] = tuple(_powers_of_two(min(world_size, max(cfg.num_layers // 2, 1))))
        if self.ep is None:
            experts = cfg.num_routed_experts if cfg.is_moe else 1
            derived["ep"] = tuple(e for e in _powers_of_two(min(experts, world_size))
                                  if experts % e == 0)
        if self.zero is None:
            derived["zero"] = (1, 3)
        space = replace(self, **derived)

        def count(sp):
            n = 1
            for f in fields(sp):
                if f.name != "pp_ends":
                    n *= len(getattr(sp, f.name))
            return n

        while count(space) > MAX_DEFAULT_CANDIDATES:
            thinnable = [name for name in ("ep", "pp")
                         if name in derived and len(getattr(space, name)) > 1]
            if not thinnable:
                break
            name = max(thinnable, key=lambda n: (len(getattr(space, n)), n == "ep"))
            space = replace(space, **{name: getattr(space, name)[1:]})
        return space

    def __post_init__(self) -> None:
        from tracemem.schedules import SCHEDULES

        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name == "pp_ends":
                if value not in PP_ENDS:
                    raise TracememError(f"--pp-ends {value!r} is invalid; choose one of "
                                        f"{', '.join(PP_ENDS)}")
                continue
            if value is None and f.name in _DERIVED:
                continue
            if not isinstance(value, tuple) or not value:
                raise TracememError(f"{flag} needs at least one value")
            for item in value:
                if f.name == "sp":
                    ok = isinstance(item, bool)
                elif f.name == "recompute":
                    ok = item in RECOMPUTES
                elif f.name == "schedule":
                    ok = item in SCHEDULES
                elif f.name == "zero":
                    ok = item in (0, 1, 2, 3) and not isinstance(item, bool)
                else:
                    ok = isinstance(item, int) and not isinstance(item, bool) and item > 0
                if not ok:
                    choices = {"sp": "on, off", "recompute": ", ".join(RECOMPUTES),
                               "schedule": ", ".join(SCHEDULES), "zero": "0, 1, 2, 3"}
                    raise TracememError(f"{flag} value {item!r} is invalid; give "
                                        f"{choices.get(f.name, 'positive integers')}, "
                                        f"comma-separated")


@dataclass(frozen=True)
class Layout:
    """One job: ``estimate`` keywords beyond the model, world size and sequence length."""

    tp: int
    sp: bool
    cp: int
    ep: int
    etp: int
    pp: int
    vpp: int
    pp_first_stage_layers: int | None
    pp_last_stage_layers: int | None
    micro_batch_size: int
    num_microbatches: int
    recompute: str
    zero: int
    schedule: str

    def job_fields(self) -> dict[str, Any]:
        """The ``Job`` fields this layout sets (a given job's own layer layout gives way)."""
        return asdict(self) | {"pp_layout": None,
                               "account_for_embedding_in_pipeline_split": False,
                               "account_for_loss_in_pipeline_split": False}

    def family(self) -> tuple:
        """What its traces depend on among the layout's fields: layouts of one family share
        their rank-class traces (all but ZeRO below 3, the schedule and M)."""
        return (self.tp, self.sp, self.cp, self.ep, self.etp, self.pp, self.vpp,
                self.pp_first_stage_layers, self.pp_last_stage_layers, self.micro_batch_size,
                self.recompute, self.zero == 3)

    def flags(self) -> str:
        """The ``tracemem estimate`` flags of this layout."""
        parts = [f"--tp {self.tp}"] + (["--sp"] if self.sp else [])
        parts += [f"--cp {self.cp}", f"--ep {self.ep}", f"--etp {self.etp}", f"--pp {self.pp}"]
        if self.vpp > 1:
            parts.append(f"--vpp {self.vpp}")
        if self.pp_first_stage_layers is not None:
            parts.append(f"--pp-first-stage-layers {self.pp_first_stage_layers}")
        if self.pp_last_stage_layers is not None:
            parts.append(f"--pp-last-stage-layers {self.pp_last_stage_layers}")
        parts += [f"--micro-batch-size {self.micro_batch_size}",
                  f"--num-microbatches {self.num_microbatches}",
                  f"--recompute {self.recompute}", f"--zero {self.zero}",
                  f"--schedule {self.schedule}"]
        return " ".join(parts)


def pp_layouts(num_layers: int, pp: int, vpp: int, mode: str = "suggested"
               ) -> list[tuple[int | None, int | None]]:
    """``(first, last)`` stage layers (None, None: an even split) of ``num_layers`` over
    ``pp`` ranks with ``vpp`` chunks each that Megatron-Core accepts (the module docstring),
    restricted by ``mode`` (``PP_ENDS``), in order of ``first`` descending.

    >>> pp_layouts(61, 16, 1)
    [(4, 1)]
    >>> pp_layouts(4, 2, 1, "all")
    [(None, None), (3, 1), (1, 3)]
    """
    stages = pp * vpp
    even = [(None, None)] if num_layers % stages == 0 else []
    if pp < 2:
        return even
    found = []  # (first, last, middle layers per rank)
    for first in range(1, num_layers + 1):
        for last in range(1, num_layers - first + 1):
            rest, middle = num_layers - first - last, pp - 2
            if (rest == 0) != (middle == 0) or (middle and rest % middle):
                continue
            per = rest // middle if middle else 0
            if vpp > 1 and (first % vpp or last % vpp or per % vpp):
                continue
            found.append((first, last, per))
    if mode == "all":
        ends = [(f, l) for f, l, _ in found]
    else:
        balanced = [(f, l, per) for f, l, per in found
                    if (per and f <= per and l <= per) or (not per and abs(f - l) <= 1)]
        if mode == "balanced":
            ends = [(f, l) for f, l, _ in balanced]
        elif even or not balanced:
            return even
        else:  # the smallest largest stage, then the fewest layers last
            f, l, _ = min(balanced, key=lambda e: (max(e), e[1]))
            ends = [(f, l)]
    even_layout = [num_layers // pp] * pp if even else None
    out = list(even)
    for f, l in sorted(ends, key=lambda e: -e[0]):
        middle = (num_layers - f - l) // (pp - 2) if pp > 2 else 0
        if even_layout != [f] + [middle] * (pp - 2) + [l]:  # the even split, said once
            out.append((f, l))
    return out


def enumerate_layouts(cfg, world_size: int, seq_length: int, global_batch_size: int,
                      space: SearchSpace, ranks_per_node: int = DEFAULT_RANKS_PER_NODE
                      ) -> tuple[list[Layout], dict[str, int]]:
    """Every valid layout of model ``cfg`` (a ``ModelConfig``) in ``space`` (its None
    dimensions derived, ``SearchSpace.resolve``), in the order of the space's dimensions, and
    the number of candidates rejected per first reason (the validator's message up to its
    first digit-free clause, e.g. ``"--tp 8 must divide ..."``).

    A TP group larger than ``ranks_per_node`` is not valid here: in Megatron's rank order
    (TP fastest, ``megatron/core/parallel_state.py``) a TP group is consecutive ranks, so
    TP <= ranks per node keeps it in one node, and TP > ranks per node would run every
    layer's all-reduces or all-gathers / reduce-scatters (``tracemem.formulas.cost.tp_bytes``,
    four per layer and microbatch) over the inter-node network, which the cost model does not
    price (it assumes communication hidden). Give ``--ranks-per-node`` for larger NVLink
    domains (72 on a GB200 NVL72).

    Raises:
        TracememError: a world size, sequence length or global batch that is not a positive
            integer.
    """
    from tracemem.estimator import check_job
    from tracemem.parallel import ParallelConfig

    for flag, value in (("--world-size", world_size), ("--seq-length", seq_length),
                        ("--global-batch-size", global_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TracememError(f"{flag} {value!r} must be a positive integer")
    space = space.resolve(cfg, world_size, ranks_per_node)
    layouts: list[Layout] = []
    rejected: dict[str, int] = {}

    def reject(reason: str, count: int = 1) -> None:
        rejected[reason] = rejected.get(reason, 0) + count

    rest = len(space.micro_batch_size) * len(space.recompute) * len(space.schedule)
    for tp in space.tp:
        if tp > ranks_per_node:
            sps = len({s and tp > 1 for s in space.sp})
            reject(f"--tp {tp} spans nodes of --ranks-per-node {ranks_per_node} (TP traffic "
                   f"would cross the inter-node network)",
                   sps * len(space.cp) * len(space.ep) * len(space.etp) * len(space.pp)
                   * len(space.vpp) * len(space.zero) * rest)
            continue
        for sp in sorted({s and tp > 1 for s in space.sp}, reverse=True):
            for cp in space.cp:
                for ep in space.ep:
                    for etp in space.etp:
                        for pp in space.pp:
                            for vpp in space.vpp:
                                ends = pp_layouts(cfg.num_layers, pp, vpp, space.pp_ends)
                                if not ends:
                                    reject(f"no {space.pp_ends} layer layout of "
                                           f"{cfg.num_layers} layers over pp {pp} x vpp {vpp}",
                                           len(space.zero) * rest)
                                for first, last in ends:
                                    for zero in space.zero:
                                        try:
                                            par = ParallelConfig.create(
                                                cfg, world_size=world_size, tp=tp, sp=sp,
                                                cp=cp, ep=ep, etp=etp, pp=pp, vpp=vpp,
                                                zero=zero, pp_first_stage_layers=first,
                                                pp_last_stage_layers=last)
                                        except TracememError as error:
                                            reject(_reason(error), rest)
                                            continue
                                        layouts += _jobs(par, first, last, seq_length,
                                                         global_batch_size, space, reject,
                                                         check_job, cfg.is_moe)
    return layouts, rejected


def _jobs(par, first, last, seq_length, global_batch_size, space, reject, check_job,
          moe=False):
    out = []
    for b in space.micro_batch_size:
        if global_batch_size % (b * par.dp):
            reject("--global-batch-size not a multiple of b x DP",
                   len(space.recompute) * len(space.schedule))
            continue
        m = global_batch_size // (b * par.dp)
        for recompute in space.recompute:
            for name in space.schedule:
                try:
                    check_job(par, micro_batch_size=b, seq_length=seq_length,
                              num_microbatches=m, schedule=name, recompute=recompute,
                              moe=moe)
                except TracememError as error:
                    reject(_reason(error))
                    continue
                out.append(Layout(par.tp, par.sp, par.cp, par.ep, par.etp, par.pp, par.vpp,
                                  first, last, b, m, recompute, par.zero, name))
    return out


def _reason(error: TracememError) -> str:
    """A rejection's message, short: up to its first ';' or '('."""
    text = str(error).splitlines()[0]
    for mark in (";", " ("):
        text = text.split(mark)[0]
    return text.strip()


@dataclass
class FitRow:
    """One estimated layout (plain data; ``as_dict`` for JSON / CSV).

    Attributes:
        layout: the job; flags: its ``tracemem estimate`` flags.
        fits: every rank's reserved peak + non-PyTorch memory within ``hbm``.
        screened: only the replayed (allocated) peaks were computed: a rank's alone is over
            ``hbm`` (reserved >= allocated), so it does not fit and ``needed_bytes`` is a lower
            bound; before_tracing: screened on a rank's static memory alone, untraced
            (``needed_bytes`` then its static memory + non-PyTorch memory).
        needed_bytes: the most a rank needs: reserved peak + non-PyTorch memory (screened:
            allocated peak + non-PyTorch memory, at least what it needs).
        worst_pp_stage: the pipeline stage of that rank; peak_bytes: its allocated peak.
        headroom_bytes: hbm - needed (negative: over by that much; screened: at least).
        bubble: pipeline bubble fraction; recompute_overhead: extra compute of the recompute
            mode; cost: step time over ideal compute, (1 + recompute) x (1 + bubble);
            comm_bytes: TP + EP + CP bytes a rank of the busiest stage sends per step
            (``tracemem.formulas.cost``); tp / ep / cp_bytes: the parts.
        traces_computed, traces_reused: rank-class traces made for this layout, and taken from
            the cache (memory or disk).
    """

    layout: Layout
    flags: str
    fits: bool
    screened: bool
    before_tracing: bool
    needed_bytes: int
    worst_pp_stage: int
    peak_bytes: int
    headroom_bytes: int
    bubble: float
    recompute_overhead: float
    cost: float
    comm_bytes: int
    tp_bytes: int
    ep_bytes: int
    cp_bytes: int
    traces_computed: int = 0
    traces_reused: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("layout"))
        return out


@dataclass
class FitResult:
    """``fit``'s result: every row (fitting ones ranked by cost first), the closest rows that
    do not fit (estimated in full), the rejected candidates per reason, and the run's
    figures: traces computed / reused / loaded from disk, seconds, workers, engine."""

    model: str
    world_size: int
    hbm_bytes: int
    seq_length: int
    global_batch_size: int
    rows: list[FitRow]
    closest: list[FitRow]
    rejected: dict[str, int]
    traces: dict[str, int]
    seconds: float
    workers: int
    engine: str
    settings: dict = field(default_factory=dict)
    job: Any = None  # the Job given (else the first layout's): what the answers refer to

    @property
    def fitting(self) -> list[FitRow]:
        return [r for r in self.rows if r.fits]


def layout_cost(cfg, par, layout: Layout, seq_length: int) -> tuple[float, int, int, int, int]:
    """``(bubble, comm, tp, ep, cp bytes per step)`` of ``layout`` (``tracemem.formulas.cost``):
    per-layer bytes over the decoder layers of the busiest pipeline rank (its layers summed
    over its chunks, MoE layers with EP bytes), times the M microbatches."""
    from tracemem.formulas import cost
    from tracemem.schedules import placement

    where = placement(layout.schedule, par.pp, par.vpp, layout.num_microbatches)
    b, s, m = layout.micro_batch_size, seq_length, layout.num_microbatches
    h = cfg.hidden_size
    per_tp = cost.tp_bytes(b, s, h, par.tp, par.cp) if par.tp > 1 else 0
    per_ep = cost.ep_bytes(b, s, h, cfg.num_experts_per_tok, par.ep, par.cp,
                           par.tp if par.sp else 1) if par.ep > 1 else 0
    # CP exchanges keys and values: MLA's per-head keys and values (every head), GQA's
    # key / value heads (head_dim each)
    kv_heads = cfg.num_attention_heads if cfg.is_mla else cfg.num_key_value_heads
    d_k, d_v = (cfg.qk_head_dim, cfg.v_head_dim) if cfg.is_mla else (cfg.head_dim, cfg.head_dim)
    per_cp = cost.cp_bytes(b, s, kv_heads, d_k, d_v, par.tp, par.cp) if par.cp > 1 else 0
    best = (0, 0, 0)
    for stage in range(par.pp):
        layers = [i for chunk in par.layers_of_stage(stage, where) for i in chunk]
        moe = sum(cfg.is_moe_layer(i) for i in layers)
        parts = (per_tp * len(layers) * m, per_ep * moe * m, per_cp * len(layers) * m)
        if sum(parts) > sum(best):
            best = parts
    bubble = cost.bubble_fraction(layout.schedule, par.pp, par.vpp, m)
    return bubble, sum(best), *best


# one TraceCache per worker process (and for the serial engine, per run): module state, so
# that the tasks a worker runs share it
_WORKER_CACHE: dict[str, Any] = {}


def _worker_cache(cache_dir: str | None, run_id: str):
    from tracemem.estimator import TraceCache

    if _WORKER_CACHE.get("run") != run_id:
        _WORKER_CACHE.clear()
        _WORKER_CACHE.update(run=run_id, cache=TraceCache(cache_dir))
    return _WORKER_CACHE["cache"]


def _run_group(job, layouts: list[Layout], cache_dir: str | None, run_id: str,
               screen: bool = True) -> tuple[list[FitRow], dict[str, int]]:
    """Estimate ``layouts`` (one trace family) in this process, each as ``dataclasses.replace``
    of the base ``job`` (``fit``'s): the rows, and this call's trace counts."""
    from tracemem.estimator import estimate
    from tracemem.formulas.cost import recompute_overhead, step_cost

    cache = _worker_cache(cache_dir, run_id)
    before = cache.counts()
    rows = []
    for layout in layouts:
        start = cache.counts()
        one = replace(job, **layout.job_fields())
        result = estimate(one, trace_cache=cache, screen=screen)
        outside = one.non_pytorch_memory_bytes
        needed = [(r.peak_bytes if result.screened else r.reserved_peak_bytes) + outside
                  for r in result.ranks]
        worst = max(range(len(needed)), key=needed.__getitem__)
        bubble, comm, tp_b, ep_b, cp_b = layout_cost(one.config, one.parallel, layout,
                                                     one.seq_length)
        overhead = recompute_overhead(layout.recompute, one.seq_length, one.config.hidden_size)
        end = cache.counts()
        rows.append(FitRow(
            layout, layout.flags(),
            fits=not result.screened and all(r.fits for r in result.ranks),
            screened=result.screened, before_tracing=result.before_tracing,
            needed_bytes=needed[worst],
            worst_pp_stage=result.ranks[worst].pp_stage,
            peak_bytes=result.ranks[worst].peak_bytes,
            headroom_bytes=result.hbm_bytes - needed[worst], bubble=bubble,
            recompute_overhead=overhead, cost=step_cost(bubble, overhead), comm_bytes=comm,
            tp_bytes=tp_b, ep_bytes=ep_b, cp_bytes=cp_b,
            traces_computed=end["computed"] - start["computed"],
            traces_reused=(end["reused"] + end["loaded"]) - (start["reused"] + start["loaded"])))
    after = cache.counts()
    return rows, {k: after[k] - before[k] for k in after}


def _work(layout: Layout) -> int:
    """A layout's expected share of ``fit``'s time, for the order of the work and the ETA
    only (no figure depends on it): its number of microbatches M, to which the caching
    allocator's walk of every stage, most of a layout's time, is proportional (its stages'
    events together are M times the model's layers' events; docs/benchmarks.md, "Fewer
    probes where the allocator's state does not repeat"), plus one for its traces."""
    return layout.num_microbatches + 1


def _groups(layouts: Iterable[Layout]) -> list[list[Layout]]:
    """Layouts by trace family (``Layout.family``): each family goes to one worker, which
    traces its rank classes once; the families with the most work (``_work``) first, so the
    long tasks start early."""
    families: dict[tuple, list[Layout]] = {}
    for layout in layouts:
        families.setdefault(layout.family(), []).append(layout)
    return sorted(families.values(), key=lambda group: sum(map(_work, group)), reverse=True)


# Seconds to wait for a Ray cluster's address to answer before ray.init, and Ray's own
# connection attempts to its GCS (RAY_gcs_server_port_wait_time_s, about 1 s + one connection
# timeout each; Ray's default retries for about 120 s, printing nothing).
RAY_CONNECT_TIMEOUT_S = 10
RAY_GCS_RETRIES = 5
RAY_INIT_TIMEOUT_S = 60  # the whole ray.init: starting a local instance takes ~7 s here


def _ray_init(ray, address: str | None) -> None:
    """``ray.init`` that fails in bounded time with one line, and that a signal stops.

    An explicit ``host:port`` (or ``ray://host:port``) address is tried first with a plain TCP
    connection (``RAY_CONNECT_TIMEOUT_S``): nothing listening is a one-line error at once,
    where Ray retries for about two minutes. Connecting to a given address, Ray's own GCS
    retries are bounded by ``RAY_gcs_server_port_wait_time_s`` (``RAY_GCS_RETRIES``, unless the
    environment sets it). Python's handlers and timeouts do not run while Ray's C++ client
    waits in the main thread (where Ray must be started: started in another thread, its
    tasks never return): ``_Watchdog`` ends the process on SIGTERM at once and, from the CLI
    (``EXIT_ON_RAY_TIMEOUT``), after ``RAY_INIT_TIMEOUT_S`` with one line.

    Raises:
        TracememError: the address does not answer, or Ray does not start or connect.
    """
    import socket

    where = f"--engine ray --address {address}"
    host, _, port = (address or "").removeprefix("ray://").rpartition(":")
    if address not in (None, "auto") and host and port.isdigit():
        try:
            socket.create_connection((host.strip("[]"), int(port)),
                                     timeout=RAY_CONNECT_TIMEOUT_S).close()
        except (OSError, OverflowError, ValueError) as error:
            reason = (f"no answer in {RAY_CONNECT_TIMEOUT_S} s" if isinstance(error, TimeoutError)
                      else str(error) or type(error).__name__)
            raise TracememError(f"{where}: nothing answers there ({reason}); start the "
                                f"cluster (ray start --head) or give its address, or drop "
                                f"--address to start a local Ray instance") from None
    # only when connecting: starting a local instance, Ray's wait for its own GCS stays Ray's
    ours = address is not None and "RAY_gcs_server_port_wait_time_s" not in os.environ
    if ours:
        os.environ["RAY_gcs_server_port_wait_time_s"] = str(RAY_GCS_RETRIES)
    watchdog = _Watchdog(where)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError, ...
        text = str(error).strip()
        raise TracememError(f"{where}: Ray did not start or connect: "
                            f"{text.splitlines()[0] if text else type(error).__name__}") \
            from None
    finally:
        watchdog.stop()
        if ours:
            os.environ.pop("RAY_gcs_server_port_wait_time_s", None)


# Set by the CLI (tracemem fit): a ray.init still waiting after RAY_INIT_TIMEOUT_S ends the
# process with one line and exit code 2. A library caller (a notebook) is not ended: its
# ray.init runs to Ray's own limit.
EXIT_ON_RAY_TIMEOUT = False


class _Watchdog:
    """While ``ray.init`` waits in Ray's C++ client (in the main thread, where Ray needs it),
    Python runs no signal handler and no timeout: this thread does both. It watches the
    interpreter's signal wakeup descriptor (``signal.set_wakeup_fd``: written at once by the
    C-level handler), so a SIGTERM ends the process at once (exit 143, SIGTERM's own
    meaning), and, with ``EXIT_ON_RAY_TIMEOUT``, it ends it after ``RAY_INIT_TIMEOUT_S`` with
    one line naming ``where``. Outside the main thread it does nothing."""

    def __init__(self, where: str) -> None:
        import signal
        import threading

        self.previous = None
        self.read, self.write = os.pipe()
        self.done = threading.Event()
        try:
            os.set_blocking(self.write, False)
            self.previous = signal.set_wakeup_fd(self.write)
        except ValueError:  # not the main thread
            self._close()
            return
        self.thread = threading.Thread(target=self._watch, args=(where,), daemon=True,
                                       name="tracemem-ray-watchdog")
        self.thread.start()

    def _watch(self, where: str) -> None:
        import select
        import signal
        import sys

        deadline = time.monotonic() + RAY_INIT_TIMEOUT_S
        while not self.done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 and EXIT_ON_RAY_TIMEOUT:
                print(f"tracemem: error: {where}: Ray did not start or connect in "
                      f"{RAY_INIT_TIMEOUT_S} s; check that a Ray cluster's GCS listens there "
                      f"(ray status)", file=sys.stderr, flush=True)
                os._exit(2)
            ready, _, _ = select.select([self.read], [], [], max(0.05, min(left, 0.5)))
            if ready and not self.done.is_set():
                for signum in os.read(self.read, 64):
                    if signum == signal.SIGTERM:
                        print(f"tracemem: stopped by SIGTERM while {where} connected",
                              file=sys.stderr, flush=True)
                        os._exit(128 + signal.SIGTERM)

    def stop(self) -> None:
        import signal

        if self.previous is None:
            return
        self.done.set()
        self.thread.join(1)
        signal.set_wakeup_fd(self.previous)
        self._close()
        self.previous = None

    def _close(self) -> None:
        for fd in (self.read, self.write):
            try:
                os.close(fd)
            except OSError:
                pass


class _Engine:
    """Runs groups of layouts (``_run_group``) and hands each group's result to ``report``
    as it completes: in this process (one local worker), in ``concurrent.futures`` worker
    processes (kept for the whole run, so their trace caches are too), or as Ray tasks."""

    def __init__(self, engine: str, workers: int, address: str | None) -> None:
        self.engine, self.workers, self.pool, self.ray, self.started = engine, workers, None, \
            None, False
        if engine == "ray":
            try:
                import ray
            except ImportError:
                raise TracememError("--engine ray needs Ray: pip install 'tracemem[ray]'") \
                    from None
            self.ray = ray
            if not ray.is_initialized():
                _ray_init(ray, address)
                self.started = True
            self.task = ray.remote(_run_group)
        elif workers > 1:
            import concurrent.futures as cf
            import multiprocessing

            # spawn, not fork: a forked torch can deadlock on its threads' locks; workers
            # ignore Ctrl-C (the terminal sends it to them too): this process ends them
            self.pool = cf.ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_ignore_interrupts)

    def run(self, job, groups, screen: bool, report) -> None:
        """``job``: ``(base Job, cache_dir, run id)``."""
        if self.ray is not None:
            pending = [self.task.remote(*job[:1], group, *job[1:], screen) for group in groups]
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                for ref in done:
                    report(*self.ray.get(ref))
        elif self.pool is not None:
            import concurrent.futures as cf

            futures = [self.pool.submit(_run_group, job[0], group, *job[1:], screen)
                       for group in groups]
            for future in cf.as_completed(futures):
                report(*future.result())
        else:
            from tracemem.torch_state import preserved_torch_state

            for group in groups:  # in this process: its torch state kept (an interrupt)
                with preserved_torch_state():
                    done = _run_group(job[0], group, *job[1:], screen)
                report(*done)

    def close(self, interrupted: bool = False) -> None:
        """Shut the workers down; ``interrupted`` (Ctrl-C): end them now, not after their
        current layouts (a worker waiting on its queue would never wake for a join)."""
        if self.pool is not None:
            if interrupted:
                for process in list(getattr(self.pool, "_processes", {}).values()):
                    process.terminate()
            self.pool.shutdown(wait=not interrupted, cancel_futures=True)
        if self.started:
            self.ray.shutdown()


def _ignore_interrupts() -> None:
    """A local worker's initializer: SIGINT ignored (``_Engine.close`` ends the workers)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def fit(model, *, space: SearchSpace | None = None, workers: int | None = None,
        engine: str = "local", address: str | None = None, cache_dir: str | None = None,
        closest: int = DEFAULT_CLOSEST, progress: Callable[[dict], None] | None = None,
        **job_fields) -> FitResult:
    """Estimate every valid layout of a job on its GPUs (``enumerate_layouts`` over ``space``)
    and say which fit in its ``hbm``.

    Args:
        model: a ``tracemem.job.Job`` (its world size, ``hbm``, sequence length and global
            batch, and every setting the search does not vary; the search's dimensions
            replace its own: TP, SP, CP, EP, ETP, PP and its layer layout, VPP, b, M,
            recompute, ZeRO, schedule), or a preset name, config.json path or ``ModelConfig``
            with ``job_fields`` world_size, hbm (e.g. "80GiB"), seq_length and
            global_batch_size, and any other ``Job`` field fixed for every layout (kernels,
            kernel_options, attention, precision, non_pytorch_memory, ...).
        space: the ``SearchSpace`` (default ``SearchSpace()``); its None dimensions are
            derived from the model and the world size (``SearchSpace.resolve``), with
            TP within a node of the job's ``ranks_per_node`` GPUs.
        workers: worker processes (default: every core, ``os.cpu_count()``); 1 runs in this
            process. Ignored by the ray engine.
        engine: "local" or "ray" (``address``: a Ray cluster, "auto" for the running one;
            None starts a local instance).
        cache_dir: a directory for the on-disk trace cache (``tracemem.estimator.TraceCache``).
        closest: how many of the layouts that do not fit to estimate in full (the closest by
            their lower bound), to say by how much each is over.
        progress: called with ``{"done", "total", "layouts", "computed", "reused", "eta_s"}``
            after each group of layouts (``done`` / ``total``: estimates, the closest layouts'
            full estimates counted after the ``layouts`` valid ones; ``eta_s``: the seconds so
            far times the work left over the work done, each layout's work its M + 1,
            ``_work``).

    Each layout is ``dataclasses.replace(base, **layout.job_fields())`` of one base ``Job``,
    each validated here before any worker starts: a layout the ``Job`` refuses with the fixed
    fields is rejected (counted in ``FitResult.rejected`` under the refusal's reason).

    Raises:
        TracememError: invalid input (the flag, the value and a fix), no valid layout in the
            space, or an unknown engine.
    """
    from modeling import ModelConfig, load_config
    from tracemem.job import Job, check_fields, job_fields as names, parse_bytes

    start = time.perf_counter()
    if isinstance(model, Job):
        if job_fields:
            raise TracememError(f"fit(job, {next(iter(job_fields))}=...): change the Job "
                                f"with dataclasses.replace(job, ...)")
        fixed = {name: getattr(model, name) for name in names()}
        fixed["global_batch_size"] = model.global_batch
        cfg = model.model
    else:
        check_fields(job_fields)
        for key in ("world_size", "hbm", "seq_length", "global_batch_size"):
            if job_fields.get(key) is None:
                raise TracememError(f"fit needs --{key.replace('_', '-')}")
        cfg = model if isinstance(model, ModelConfig) else load_config(model)
        fixed = dict(job_fields, model=cfg)
    if fixed.get("hbm") is None:
        raise TracememError("fit needs --hbm (e.g. --hbm 80GiB): the memory to fit in")
    parse_bytes(fixed["hbm"])  # a bad size before any layout is enumerated
    swept = sorted(set(job_fields) & (set(Layout.__dataclass_fields__) | {"pp_layout"}))
    if swept:
        raise TracememError(f"fit: {swept[0]!r} is a search-space dimension; give it in space")
    world_size, seq_length = fixed["world_size"], fixed["seq_length"]
    global_batch_size = fixed["global_batch_size"]
    # the dimensions not given are derived from the model and the world size (a dense
    # model's EP is 1); TP stays within a node of ranks_per_node GPUs
    ranks_per_node = fixed.get("ranks_per_node", DEFAULT_RANKS_PER_NODE)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node <= 0:
        raise TracememError(f"--ranks-per-node {ranks_per_node!r} must be a positive integer")
    space = (space or SearchSpace()).resolve(cfg, world_size, ranks_per_node)
    if engine not in ENGINES:
        raise TracememError(f"--engine {engine!r} is invalid; choose one of "
                            f"{', '.join(ENGINES)}")
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0:
        raise TracememError(f"--workers {workers!r} must be a positive integer")
    if isinstance(closest, bool) or not isinstance(closest, int) or closest < 0:
        raise TracememError(f"--closest {closest!r} must be 0 or a positive integer")
    if engine == "local" and address is not None:
        raise TracememError("--address applies to --engine ray; drop it or add --engine ray")
    layouts, rejected = enumerate_layouts(cfg, world_size, seq_length, global_batch_size,
                                          space, ranks_per_node=ranks_per_node)
    if not layouts:
        reasons = "; ".join(f"{why} ({n} layout{'s' * (n != 1)})" for why, n in
                            sorted(rejected.items(), key=lambda kv: -kv[1])[:3])
        raise TracememError(f"no valid layout of {cfg.name} on {world_size} GPUs in the search "
                            f"space ({reasons}); widen the space flags")
    fixed.pop("num_microbatches", None)  # each layout's M follows from the global batch
    # every layout validated as the Job it will be, here, before any worker starts: a layout
    # the Job refuses with the fixed fields (--cpu-offloading-num-layers with PP > 1, say) is
    # rejected with its reason; when the Job refuses every layout, its first one-line error
    # is raised (a fixed field that is wrong whatever the layout)
    base, first_error, valid = None, None, []
    for layout in layouts:
        try:
            one = Job(**(fixed | layout.job_fields()))
        except TracememError as error:
            first_error = first_error or error
            reason = _reason(error)
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        base = base or one
        valid.append(layout)
    if base is None:
        raise first_error
    layouts = valid
    job = (base, cache_dir, f"{os.getpid()}-{time.time_ns()}")
    if cache_dir is not None:
        from tracemem.estimator import TraceCache

        TraceCache(cache_dir)  # the directory made, or a one-line error
    counts = {"computed": 0, "reused": 0, "loaded": 0}
    rows: list[FitRow] = []
    total = [len(layouts)]
    # the ETA: the time so far, scaled by the work left over the work done (_work)
    work = [sum(map(_work, layouts)), 0]

    done = [0]

    def report(group_rows, group_counts):
        rows.extend(group_rows)
        done[0] += len(group_rows)
        work[1] += sum(_work(r.layout) for r in group_rows)
        for key in counts:
            counts[key] += group_counts[key]
        if progress:
            elapsed = time.perf_counter() - start
            eta = elapsed / work[1] * (work[0] - work[1])
            progress({"done": done[0], "total": total[0], "layouts": len(layouts),
                      "computed": counts["computed"],
                      "reused": counts["reused"] + counts["loaded"], "eta_s": eta})

    runner = _Engine(engine, min(workers, len(layouts)), address)
    interrupted = False
    try:
        runner.run(job, _groups(layouts), True, report)
        order = {layout: i for i, layout in enumerate(layouts)}
        rows.sort(key=lambda r: order[r.layout])
        screened_rows = list(rows)
        # the closest misses, exactly: a screened row's needs are a lower bound, so estimate
        # in full the screened rows among the closest until the closest are all exact
        known = {r.layout: r for r in screened_rows if not r.fits}
        while True:
            nearest = sorted(known.values(), key=lambda r: r.needed_bytes)[:closest]
            todo = [r.layout for r in nearest if r.screened]
            if not todo:
                break
            rows.clear()
            total[0] += len(todo)
            work[0] += sum(map(_work, todo))
            runner.run(job, [[layout] for layout in todo], False, report)
            known.update({r.layout: r for r in rows})
        exact = nearest if closest else []
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        runner.close(interrupted)
    from tracemem.formulas.cost import rank_key

    fitting = sorted((r for r in screened_rows if r.fits),
                     key=lambda r: rank_key(r.cost, r.comm_bytes))
    rest = [r for r in screened_rows if not r.fits]
    return FitResult(cfg.name, world_size, base.hbm_bytes, seq_length, global_batch_size,
                     fitting + rest, exact, rejected, counts, time.perf_counter() - start,
                     1 if engine == "ray" else runner.workers, engine, base.settings(),
                     model if isinstance(model, Job) else base)


_DIMENSIONS = {"tp": int, "sp": "onoff", "cp": int, "ep": int, "etp": int, "pp": int,
               "vpp": int, "micro_batch_size": int, "recompute": str, "zero": int,
               "schedule": str}


def search_space(**values: str | None) -> SearchSpace:
    """A ``SearchSpace`` from the command line's comma-separated strings (``tp="1,2,4"``,
    ``sp="on,off"``, ``pp_ends="all"``); None keeps a dimension's default.

    Raises:
        TracememError: an unknown dimension, a value that is not of the dimension's kind, or
            one the dimension does not take (``SearchSpace``).
    """
    kwargs: dict[str, Any] = {}
    for name, text in values.items():
        if text is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "pp_ends":
            kwargs[name] = text
            continue
        if name not in _DIMENSIONS:
            raise TracememError(f"search_space: unknown dimension {name!r}; valid: "
                                f"{', '.join(_DIMENSIONS)}, pp_ends")
        if not isinstance(text, str):
            raise TracememError(f"{flag} {text!r} must be comma-separated values, e.g. 1,2,4")
        items = [part.strip() for part in text.split(",")]
        if "" in items:
            raise TracememError(f"{flag} {text!r} has an empty value; give comma-separated "
                                f"values, e.g. 1,2,4")
        kind = _DIMENSIONS[name]
        parsed: list[Any] = []
        for item in items:
            if kind is int:
                if item.startswith("-") and item[1:].isascii() and item[1:].isdigit():
                    raise TracememError(f"{flag} value {item!r} must be a positive integer; "
                                        f"give comma-separated positive integers, e.g. 1,2,4")
                if not item.isascii() or not item.isdigit():
                    raise TracememError(f"{flag} value {item!r} is not an integer; give "
                                        f"comma-separated integers, e.g. 1,2,4")
                parsed.append(int(item))
            elif kind == "onoff":
                item = item.lower()  # as every fixed-choice flag takes any letter case
                if item not in ("on", "off"):
                    raise TracememError(f"{flag} value {item!r} is invalid; give on, off or "
                                        f"on,off")
                parsed.append(item == "on")
            else:  # recompute modes and schedules: lower-case names, any case taken
                parsed.append(item.lower())
        kwargs[name] = tuple(dict.fromkeys(parsed))
    return SearchSpace(**kwargs)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _pp_text(layout: Layout) -> str:
    if layout.pp_first_stage_layers is None:
        return str(layout.pp)
    return f"{layout.pp} ({layout.pp_first_stage_layers}/../{layout.pp_last_stage_layers})"


_COLUMNS = ("TP", "SP", "CP", "EP", "ETP", "PP (first/../last)", "VPP", "b", "M", "recompute",
            "ZeRO", "schedule")
# the layout columns the default table shows only when the rows differ in them (else they
# are said once, above the table): all but TP and PP, which every table shows
_OPTIONAL = ("SP", "CP", "EP", "ETP", "VPP", "b", "M", "recompute", "ZeRO", "schedule")


def _layout_cells(lay: Layout) -> dict[str, str]:
    return dict(zip(_COLUMNS, map(str, (
        lay.tp, "on" if lay.sp else "-", lay.cp, lay.ep, lay.etp, _pp_text(lay), lay.vpp,
        lay.micro_batch_size, lay.num_microbatches, lay.recompute, lay.zero, lay.schedule))))


def _table_row(row: FitRow, over: bool = False, columns: tuple[str, ...] = _COLUMNS,
               wide: bool = True) -> list:
    cells = _layout_cells(row.layout)
    out = [cells[c] for c in columns] + [_gib(row.needed_bytes)]
    if wide:
        out.append(str(row.worst_pp_stage))
    if over:
        return out + [_gib(-row.headroom_bytes)]
    out += [_gib(row.headroom_bytes), f"{row.cost:.3f}"]
    if wide:
        out += [f"{row.bubble:.3f}", f"{row.recompute_overhead:.3f}", _gib(row.comm_bytes)]
    return out


def _shown_columns(rows: list[FitRow], wide: bool) -> tuple[tuple[str, ...], str]:
    """The layout columns of the tables, and the line that says the constant ones (the
    default table; ``wide``: every column, no line)."""
    if wide or not rows:
        return _COLUMNS, ""
    cells = [_layout_cells(r.layout) for r in rows]
    constant = [c for c in _OPTIONAL if len({row[c] for row in cells}) == 1]
    shown = tuple(c for c in _COLUMNS if c not in constant)
    import textwrap

    return shown, (textwrap.fill("Every layout below: " + ", ".join(
        f"{c} {cells[0][c]}" for c in constant) + ".", 100, break_on_hyphens=False)
        if constant else "")


def _hbm_flag(hbm_bytes: int) -> str:
    """``--hbm`` as its bytes allow exactly: whole GiB, whole GB (10^9) or bytes."""
    if hbm_bytes % 2**30 == 0:
        return f"{hbm_bytes // 2**30}GiB"
    if hbm_bytes % 10**9 == 0:
        return f"{hbm_bytes // 10**9}GB"
    return f"{hbm_bytes}B"


def format_fit(result: FitResult, top: int = 20, wide: bool = False, settings: str = "") -> str:
    """The fitting layouts ranked by cost (the first ``top``), the closest that do not fit
    and by how much, and a summary of the run (GiB = 2^30 B). The default tables fit 100
    columns: the layout columns in which the rows differ (the others said once), needs,
    headroom and cost; ``wide``: every column (the worst stage, bubble, recompute, comm).
    ``settings``: the ``tracemem estimate`` flags of the settings every layout shares (the
    command line's, ``tracemem fit``'s "every layout's settings"), added to the best layout's
    command so that it runs the same job."""
    from tracemem.report import plain_table

    hbm = _gib(result.hbm_bytes)
    fitting = result.fitting
    shown = fitting[:top]
    columns, constant = _shown_columns(shown + list(result.closest), wide)
    gpus = "GPU" if result.world_size == 1 else "GPUs"
    lines = [f"{result.model} on {result.world_size} {gpus} of {hbm} GiB, s={result.seq_length}, "
             f"global batch {result.global_batch_size} sequences: {len(result.rows)} valid "
             f"layout{'s' * (len(result.rows) != 1)} estimated, {len(fitting)} fit", ""]
    if constant:
        lines.append(constant)
    stage = ["at stage"] if wide else []
    if fitting:
        best = "" if len(shown) == len(fitting) else f"; the best {len(shown)} of {len(fitting)}"
        lines.append(f"Layouts that fit, ranked by cost (step time over ideal compute), then "
                     f"communication bytes per step{best}:")
        lines.append(plain_table([[str(i + 1)] + _table_row(r, columns=columns, wide=wide)
                                  for i, r in enumerate(shown)],
                                 ["#", *columns, "needs GiB", *stage, "headroom GiB", "cost"]
                                 + (["bubble", "recompute", "comm GiB/step"] if wide else []),
                                 ["left"] * (len(columns) + len(stage) + 4 + 3 * wide)))
        if result.job is not None and result.job.origin == "megatron":
            from tracemem.frontdoors import megatron_flag_changes

            lines.append("best, as changes to the Megatron-LM arguments: " + (
                megatron_flag_changes(shown[0].layout.job_fields(), job=result.job)
                or "none") + (f"; with tracemem's flags {settings}" if settings else ""))
        else:
            lines.append(f"best: tracemem estimate --model {result.model} --world-size "
                         f"{result.world_size} --seq-length {result.seq_length} "
                         f"{shown[0].flags} " + (f"{settings} " if settings else "")
                         + f"--hbm {_hbm_flag(result.hbm_bytes)}")
    else:
        lines.append(f"No layout in the search space fits in {hbm} GiB.")
    if result.closest:
        lines += ["", "Closest layouts that do not fit (estimated in full), and by how much:"]
        lines.append(plain_table([_table_row(r, over=True, columns=columns, wide=wide)
                                  for r in result.closest],
                                 [*columns, "needs GiB", *stage, "over by GiB"],
                                 ["left"] * (len(columns) + len(stage) + 2)))
    t = result.traces
    asked = t["computed"] + t["reused"] + t["loaded"]
    reused = t["reused"] + t["loaded"]
    per_node = (result.settings or {}).get("ranks_per_node", DEFAULT_RANKS_PER_NODE)
    lines += ["", "needs: the most any rank needs, its reserved peak (simulated CUDA caching "
                  "allocator) + non-PyTorch memory" + (", at that pipeline stage" if wide else "")
              + f"; headroom: {hbm} GiB minus that. cost = (1 + recompute) x (1 + bubble): "
                "bubble, the schedule's idle / compute time; recompute, the extra compute of "
                "the recompute mode" + ("; comm: TP + EP + CP bytes a rank of the busiest "
                                        "stage sends per step, assumed hidden, a tie-breaker"
                                        if wide else "; ties broken by the bytes a rank sends "
                                        "per step (--wide: comm)")
              + f"; TP within a node of {per_node} ranks (--ranks-per-node) "
                "(tracemem/formulas/cost.py, each term cited).",
              f"Rank-class traces: {asked} needed, {t['computed']} computed, {reused} reused "
              f"({reused / asked:.0%})" + (f", {t['loaded']} of them from --cache-dir"
                                           if t["loaded"] else "") +
              f"; {result.seconds:.1f} s on {result.workers} "
              f"{'Ray' if result.engine == 'ray' else 'local'} worker"
              f"{'s' if result.workers != 1 else ''}."]
    screened = sum(r.screened for r in result.rows)
    if screened:
        static = sum(r.before_tracing for r in result.rows)
        lines.append(f"Not simulated: {screened} of the {len(result.rows)} layouts, over "
                     f"{hbm} GiB on a lower bound alone (a rank's replayed peak + non-PyTorch "
                     f"memory; the reserved peak can only be higher)"
                     + (f", {static} of them on static memory alone, before tracing"
                        if static else "")
                     + ("; the closest of them were then estimated in full (above)"
                        if result.closest else "") + ".")
    if result.rejected:
        skipped = sum(result.rejected.values())
        reasons = sorted(result.rejected.items(), key=lambda kv: -kv[1])
        if wide or len(reasons) <= 3:
            lines.append(f"Not valid, skipped: {skipped} candidate{'s' * (skipped != 1)}; the "
                         f"reason{'s' * (len(reasons) != 1)}: " +
                         "; ".join(f"{why} ({n})" for why, n in reasons) + ".")
        else:
            lines.append(f"Not valid, skipped: {skipped} candidate{'s' * (skipped != 1)}; the "
                         f"most common reasons "
                         f"(3 of {len(reasons)}; --wide gives every one): " +
                         "; ".join(f"{why} ({n})" for why, n in reasons[:3]) + ".")
    if not wide:
        lines.append("--wide adds the worst stage, bubble, recompute and comm columns; --json "
                     "/ --csv give every row, bytes as int.")
    return "\n".join(lines)


def fit_records(result: FitResult) -> list[dict[str, Any]]:
    """Every estimated layout once, as a flat dict (bytes as int), in ``result.rows``' order;
    a closest non-fitting layout estimated in full (``result.closest``) replaces its screened
    row. ``exact``: the row's figures come from the allocator simulation (not a screen's
    lower bound)."""
    full = {row.layout: row for row in result.closest}
    out = []
    for row in result.rows:
        row = full.get(row.layout, row)
        record = row.as_dict()
        record["exact"] = not row.screened
        out.append(record)
    return out


def format_fit_json(result: FitResult) -> str:
    import json

    return json.dumps({
        "model": result.model, "world_size": result.world_size,
        "hbm_bytes": result.hbm_bytes, "seq_length": result.seq_length,
        "global_batch_size": result.global_batch_size, "traces": result.traces,
        "seconds": result.seconds, "workers": result.workers, "engine": result.engine,
        "rejected": result.rejected, "rows": fit_records(result)}, indent=1)


def format_fit_csv(result: FitResult) -> str:
    import csv
    import io

    records = fit_records(result)
    buffer = io.StringIO()
    if records:
        writer = csv.DictWriter(buffer, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    return buffer.getvalue().rstrip("\n")
