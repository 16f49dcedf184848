"""``ParallelConfig``: a validated parallel layout (TP, SP, CP, EP, ETP, PP, VPP, DP, EDP, the
layer-to-stage layout, ZeRO stage, precision recipe and sharding plan).

Conventions (Megatron-Core, ``megatron/core/parallel_state.py``, ``initialize_model_parallel``
with MoE parallel folding): dense layers use world = TP * CP * PP * DP; expert layers use
world = ETP * EP * PP * EDP, so DP = world / (TP * CP * PP) and EDP = world / (ETP * EP * PP).
Ranks are ordered TP fastest, then CP, DP, PP (Megatron's default order "tp-cp-ep-dp-pp");
``stage_of(rank)`` follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracemem.errors import TracememError

__all__ = ["ParallelConfig", "PRECISIONS", "PLANS", "parse_layout"]

PRECISIONS = ("megatron", "paper-2502.07846", "deepseek-v3")
PLANS = ("megatron", "paper-2502.07846")


def _divisors(n: int, limit: int = 8) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0][:limit]
    return ", ".join(str(d) for d in found) + (", ..." if len(found) == limit else "")


def parse_layout(text: str) -> tuple[int, ...]:
    """``"4*15,1"`` or ``"4,4,...,1"`` -> layers per stage.

    Raises:
        TracememError: not a comma-separated list of positive integers (``N*K`` repeats N).
    """
    out: list[int] = []
    try:
        for part in text.split(","):
            count, _, repeat = part.strip().partition("*")
            out += [int(count)] * (int(repeat) if repeat else 1)
    except ValueError:
        out = []
    if not out or any(n < 0 for n in out):
        raise TracememError(f"--pp-layout {text!r} is invalid; give layers per stage as "
                            f"comma-separated integers, N*K repeating N K times (e.g. 4*15,1)")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A parallel layout for a model with ``num_layers`` decoder layers.

    Fields: ``world_size`` (GPUs), ``tp`` (tensor parallel), ``sp`` (sequence parallel, needs
    tp > 1), ``cp`` (context parallel), ``ep`` (expert parallel), ``etp`` (expert tensor
    parallel), ``pp`` (pipeline stages), ``vpp`` (virtual stages per pipeline rank),
    ``pp_layout`` (decoder layers per virtual stage, in order; None = even split),
    ``zero`` (0: none, 1: optimizer states, 2: + gradients, 3: + parameters sharded over DP for
    dense and EDP for expert parameters), ``precision`` (``PRECISIONS``), ``plan``
    (``PLANS``). ``dp`` and ``edp`` are derived.

    Use ``ParallelConfig.create(...)``, which validates against the model and derives the rest.

    Raises:
        TracememError: any invalid combination; the message names the flag, the value and a
            valid alternative.
    """

    world_size: int
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int = 1
    pp_layout: tuple[int, ...] = ()
    zero: int = 1
    precision: str = "megatron"
    plan: str = "megatron"
    dp: int = field(init=False)
    edp: int = field(init=False)

    def __post_init__(self) -> None:
        for flag, value in (("--world-size", self.world_size), ("--tp", self.tp),
                            ("--cp", self.cp), ("--ep", self.ep), ("--etp", self.etp),
                            ("--pp", self.pp), ("--vpp", self.vpp)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TracememError(f"{flag} {value!r} must be a positive integer")
        if self.sp and self.tp == 1:
            raise TracememError("--sp needs --tp > 1 (sequence parallelism shards activations "
                                "across the tensor-parallel group); drop --sp or raise --tp")
        if self.etp > 1 and self.ep == 1:
            raise TracememError(f"--etp {self.etp} needs --ep > 1; set --ep or use --etp 1")
        if self.zero not in (0, 1, 2, 3):
            raise TracememError(f"--zero {self.zero!r} is invalid; choose 0, 1, 2 or 3")
        if self.precision not in PRECISIONS:
            raise TracememError(f"--precision {self.precision!r} is invalid; choose one of "
                                f"{', '.join(PRECISIONS)}")
        if self.plan not in PLANS:
            raise TracememError(f"--plan {self.plan!r} is invalid; choose one of "
                                f"{', '.join(PLANS)}")
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            raise TracememError(
                f"--world-size {self.world_size} is not a multiple of tp({self.tp}) * "
                f"cp({self.cp}) * pp({self.pp}) = {dense}; DP would not be an integer")
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise TracememError(
                f"--world-size {self.world_size} is not a multiple of etp({self.etp}) * "
                f"ep({self.ep}) * pp({self.pp}) = {expert}; EDP would not be an integer")
        object.__setattr__(self, "dp", self.world_size // dense)
        object.__setattr__(self, "edp", self.world_size // expert)

    @property
    def num_virtual_stages(self) -> int:
        """pp * vpp model chunks."""
        return self.pp * self.vpp

    @classmethod
    def create(cls, model_cfg, *, world_size: int, pp_layout: tuple[int, ...] | None = None,
               pp_first_stage_layers: int | None = None,
               pp_last_stage_layers: int | None = None, **degrees) -> ParallelConfig:
        """A validated layout for ``model_cfg`` (a ``modeling.ModelConfig``).

        ``pp_layout`` gives layers per virtual stage; or ``pp_first_stage_layers`` /
        ``pp_last_stage_layers`` (Megatron's ``--decoder-first/last-pipeline-num-layers``) fix
        the ends and split the rest evenly; or, with none of them, an even split.

        Raises:
            TracememError: see the class docstring; also TP not dividing the attention heads,
                EP not dividing the routed experts, more stages than layers, a layout that does
                not sum to the layer count.
        """
        probe = cls(world_size=world_size, **degrees)  # degree checks first
        layout = _layout(model_cfg.num_layers, probe.num_virtual_stages, pp_layout,
                         pp_first_stage_layers, pp_last_stage_layers)
        config = cls(world_size=world_size, pp_layout=layout, **degrees)
        config.check_model(model_cfg)
        return config

    def check_model(self, model_cfg) -> None:
        """Check the degrees against the model's sizes.

        Raises:
            TracememError: a degree that does not divide what it shards.
        """
        heads = model_cfg.num_attention_heads
        if heads % self.tp:
            raise TracememError(f"--tp {self.tp} must divide num_attention_heads ({heads}); "
                                f"try {_divisors(heads)}")
        experts = model_cfg.num_routed_experts
        if experts % self.ep:
            raise TracememError(f"--ep {self.ep} must divide n_routed_experts ({experts}); "
                                f"try {_divisors(experts)}")
        inter = model_cfg.moe_intermediate_size
        if inter % self.etp:
            raise TracememError(f"--etp {self.etp} must divide moe_intermediate_size ({inter}); "
                                f"try {_divisors(inter)}")
        for name in ("intermediate_size", "moe_intermediate_size"):
            size = getattr(model_cfg, name)
            if size % self.tp:
                raise TracememError(f"--tp {self.tp} must divide {name} ({size}); "
                                    f"try {_divisors(size)}")
        if sum(self.pp_layout) != model_cfg.num_layers:
            raise TracememError(
                f"--pp-layout sums to {sum(self.pp_layout)} layers; the model has "
                f"{model_cfg.num_layers}")

    def stage_of(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank`` (TP, CP and DP vary faster than PP).

        Raises:
            TracememError: ``rank`` outside [0, world_size).
        """
        if not 0 <= rank < self.world_size:
            raise TracememError(f"rank {rank} is outside [0, {self.world_size})")
        return rank // (self.world_size // self.pp)

    def layers_of_stage(self, stage: int) -> list[list[int]]:
        """Global layer numbers of pipeline rank ``stage``, one list per model chunk (VPP:
        chunk c of rank p is virtual stage c * pp + p, as in Megatron's interleaved schedule)."""
        starts = [sum(self.pp_layout[:v]) for v in range(self.num_virtual_stages)]
        return [list(range(starts[v], starts[v] + self.pp_layout[v]))
                for v in range(stage, self.num_virtual_stages, self.pp)]


def _layout(num_layers: int, stages: int, layout, first, last) -> tuple[int, ...]:
    if layout:
        layout = tuple(layout)
        if len(layout) != stages:
            raise TracememError(f"--pp-layout has {len(layout)} entries; it needs one per "
                                f"virtual pipeline stage, pp * vpp = {stages}")
        if sum(layout) != num_layers:
            raise TracememError(f"--pp-layout sums to {sum(layout)} layers; the model has "
                                f"{num_layers}")
        return layout
    if stages > num_layers:
        raise TracememError(f"pp * vpp = {stages} stages is more than the model's {num_layers} "
                            f"layers; lower --pp or --vpp")
    if first is not None or last is not None:
        first = num_layers // stages if first is None else first
        last = num_layers // stages if last is None else last
        middle_stages, middle_layers = stages - 2, num_layers - first - last
        if stages < 2 or first < 0 or last < 0 or middle_layers < 0 or (
                middle_stages and middle_layers % middle_stages) or (
                not middle_stages and middle_layers):
            raise TracememError(
                f"--pp-first-stage-layers {first} and --pp-last-stage-layers {last} leave "
                f"{middle_layers} layers for {max(middle_stages, 0)} middle stages, which do "
                f"not divide evenly; adjust them or give --pp-layout")
        middle = [middle_layers // middle_stages] * middle_stages if middle_stages else []
        return (first, *middle, last)
    if num_layers % stages:
        raise TracememError(
            f"{num_layers} layers do not divide into pp * vpp = {stages} stages; give "
            f"--pp-layout (e.g. {_suggest(num_layers, stages)}) or --pp-first-stage-layers / "
            f"--pp-last-stage-layers")
    return (num_layers // stages,) * stages


def _suggest(num_layers: int, stages: int) -> str:
    per = -(-num_layers // stages)
    full, rest = divmod(num_layers, per)
    if full >= stages:
        return f"{per}*{stages}"
    tail = [rest] if rest else []
    tail += [0] * (stages - full - len(tail))
    return f"{per}*{full}" + "".join(f",{n}" for n in tail)
