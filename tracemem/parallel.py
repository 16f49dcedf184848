"""``ParallelConfig``: a validated parallel layout (TP, SP, CP, EP, ETP, PP, VPP, DP, EDP, the
layer-to-stage layout, ZeRO stage, precision recipe and sharding plan).

Conventions (Megatron-Core, ``megatron/core/parallel_state.py``, ``initialize_model_parallel``
with MoE parallel folding): dense layers use world = TP * CP * PP * DP; expert layers use
world = ETP * EP * PP * EDP, so DP = world / (TP * CP * PP) and EDP = world / (ETP * EP * PP).
Ranks are ordered TP fastest, then CP, DP, PP (Megatron's default order "tp-cp-ep-dp-pp");
``stage_of(rank)`` follows from it. ``SHARDING`` is the one table of which group (DP x CP or
EDP) shards each static quantity under each ZeRO stage; ``tracemem.static`` reads it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from tracemem.errors import TracememError, divisors_hint
from tracemem.precision import PRECISION_RECIPES, Precision, resolve_precision

__all__ = ["ParallelConfig", "PRECISIONS", "PLANS", "parse_layout", "ShardingRule", "SHARDING",
           "GROUPS", "sharding_rule", "format_layout", "suggest_layout", "suggest_ends"]

PRECISIONS = tuple(PRECISION_RECIPES)
MAX_STAGES = 4096  # more virtual pipeline stages than any real job; bounds --pp-layout
_LAYOUT_PART = re.compile(r"^([0-9]+)(?:\*([0-9]+))?$", re.ASCII)
PLANS = ("megatron", "paper-2502.07846")


# The groups that shard static memory, with their sizes. Megatron-Core pinned at NVIDIA/Megatron-LM
# d98e8a6 (2026-08-22); ``parallel_state.py`` ``initialize_model_parallel``: the dense rank
# generator has cp = CP and builds the "dp-cp" groups (_DATA_PARALLEL_GROUP_WITH_CP); the expert
# rank generator has cp = 1 and dp = world / (ETP * EP * PP) (expert_data_parallel_size), so CP
# is folded into EDP.
GROUPS = {
    "dp_cp": "DP x CP = world / (TP x PP): the data-parallel group with context parallelism",
    "edp": "EDP = world / (ETP x EP x PP): the expert data-parallel group (CP folded in)",
}
# Megatron's --num-distributed-optimizer-instances N (parallel_state.py initialize_model_parallel:
# the intra-partial groups are contiguous slices of N of the DP x CP group, "Data parallel
# size should be divisible by partial DistOpt shard factor", and of the EDP group,
# create_hierarchical_groups([EDP / N, N])): the distributed optimizer and its DDP buffers
# shard over DP x CP / N and EDP / N (the ZeRO-1 rows of SHARDING name those intra groups),
# and the gradients are all-reduced across the N instances in place
# (param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync).


@dataclass(frozen=True)
class ShardingRule:
    """One row of ``SHARDING``: ``quantity`` of the ``kind`` ("dense" or "expert") parameters is
    split over ``group`` (a ``GROUPS`` key) from ZeRO stage ``zero`` up; ``source`` is the
    Megatron-Core file and function (at d98e8a6) that decides it."""

    quantity: str
    kind: str
    group: str
    zero: int
    source: str


_OPTIM = "megatron/core/optimizer/__init__.py get_megatron_optimizer"
_DDP = "megatron/core/distributed/distributed_data_parallel.py DistributedDataParallel.__init__"
_FSDP = ("megatron/core/distributed/fsdp/mcore_fsdp_adapter.py FullyShardedDataParallel "
         "(data_parallel_sharding_strategy optim_grads / optim_grads_params)")

# Every sharded quantity of static memory and the group that shards it (ZeRO stage 1 is
# Megatron's distributed optimizer; 2 and 3 Megatron-FSDP's optim_grads / optim_grads_params).
SHARDING = (
    ShardingRule("optimizer_states", "dense", "dp_cp", 1,
                 f"{_OPTIM}: dense param groups get data_parallel_group=intra_dp_cp_group"),
    ShardingRule("optimizer_states", "expert", "edp", 1,
                 f"{_OPTIM}: expert param groups get data_parallel_group=intra_expt_dp_group"),
    ShardingRule("gradients", "dense", "dp_cp", 2,
                 f"{_DDP}: dense buffers reduce-scatter over intra_dp_cp_group; {_FSDP}: "
                 f"dp_cp group"),
    ShardingRule("gradients", "expert", "edp", 2,
                 f"{_DDP}: expert buffers reduce-scatter over intra_expt_dp_group; {_FSDP}: "
                 f"expt_dp group"),
    ShardingRule("parameters", "dense", "dp_cp", 3, f"{_FSDP}: dp_cp group"),
    ShardingRule("parameters", "expert", "edp", 3, f"{_FSDP}: expt_dp group"),
    ShardingRule("zero3_gathers", "dense", "dp_cp", 3,
                 f"{_FSDP}: a unit's dense parameters all-gathered over dp_cp"),
    ShardingRule("zero3_gathers", "expert", "edp", 3,
                 f"{_FSDP}: a unit's expert parameters all-gathered over expt_dp"),
    # the distributed optimizer's step (tracemem.optimizer_step): each rank's shard of the grad
    # buffer (reduce-scattered in place over the same groups) becomes its masters' gradients
    ShardingRule("step_grad_copies", "dense", "dp_cp", 1,
                 "megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer."
                 "_copy_model_grads_to_main_grads: this rank's range of the dense buffer "
                 "(intra_dp_cp_group)"),
    ShardingRule("step_grad_copies", "expert", "edp", 1,
                 "megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer."
                 "_copy_model_grads_to_main_grads: this rank's range of the expert buffer "
                 "(intra_expt_dp_group)"),
)


def sharding_rule(quantity: str, kind: str) -> ShardingRule:
    """The ``SHARDING`` row of ``quantity`` and ``kind``.

    Raises:
        KeyError: no such row (a programming error, not user input).
    """
    for rule in SHARDING:
        if (rule.quantity, rule.kind) == (quantity, kind):
            return rule
    raise KeyError((quantity, kind))


def _multiples(n: int, of: int) -> str:
    """The multiples of ``of`` either side of ``n``."""
    below = n // of * of
    return f"{below} or {below + of}" if below else str(of)


def _world_hint(world_size: int, dense: int, expert: int, pp: int) -> str:
    """"try --world-size A or B, or --pp C or D": the world sizes either side of
    ``world_size`` that both TP x CP x PP (``dense``) and ETP x EP x PP (``expert``) divide, and
    the PPs either side of ``pp`` that divide ``world_size`` with the other degrees (where the
    world size is the given one: a recipe's, a launcher's); the PPs only where some does."""
    both = math.lcm(dense, expert)
    hint = f"try --world-size {_multiples(world_size, both)}"
    other = math.lcm(dense // pp, expert // pp)  # TP x CP and ETP x EP
    if world_size % other:
        return hint
    room = world_size // other
    near = [max((d for d in range(1, pp) if room % d == 0), default=None),
            min((d for d in range(pp + 1, room + 1) if room % d == 0), default=None)]
    near = [d for d in near if d is not None]
    return hint + (f", or --pp {' or '.join(map(str, near))}" if near else "")


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def parse_layout(text: str) -> tuple[int, ...]:
    """``"4*15,1"`` or ``"4,4,...,1"`` -> layers per stage.

    Raises:
        TracememError: not a comma-separated list of positive integers (``N*K`` repeats N).
    """
    out: list[int] = []
    for part in text.split(","):
        match = _LAYOUT_PART.match(part.strip())
        repeat = int(match[2] or 1) if match else 0
        if not match or repeat == 0 or len(out) + repeat > MAX_STAGES:
            raise TracememError(
                f"--pp-layout {text!r} is invalid; give layers per stage as comma-separated "
                f"non-negative integers, N*K repeating N K times (e.g. 4*15,1), at most "
                f"{MAX_STAGES} stages")
        out += [int(match[1])] * repeat
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """A parallel layout for a model with ``num_layers`` decoder layers.

    Fields: ``world_size`` (GPUs), ``tp`` (tensor parallel), ``sp`` (sequence parallel, needs
    tp > 1), ``cp`` (context parallel), ``ep`` (expert parallel), ``etp`` (expert tensor
    parallel), ``pp`` (pipeline stages), ``vpp`` (virtual stages per pipeline rank),
    ``pp_layout`` (decoder layers per virtual stage, in order; None = even split),
    ``zero`` (0: none, 1: optimizer states, 2: + gradients, 3: + parameters sharded over
    DP x CP for dense and EDP for expert parameters: ``SHARDING``), ``precision``
    (``PRECISIONS``, a recipe) with Megatron's precision flags overriding its fields
    (``use_precision_aware_optimizer``, ``main_grads_dtype``, ``main_params_dtype``,
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``grad_reduce_in_bf16``,
    ``store_param_remainders``, ``gradient_accumulation_fusion``; None keeps the recipe's:
    ``tracemem.precision``), ``plan`` (``PLANS``), ``num_distributed_optimizer_instances``
    (Megatron's ``--num-distributed-optimizer-instances``: ZeRO 1 shards over DP x CP / N
    and EDP / N; ``GROUPS``; with ZeRO 3 and the ``fsdp2`` recipe, torchtitan's HSDP
    ``data_parallel_replicate_degree``: FSDP2 shards everything over DP x CP / N and
    all-reduces the gradients across the N replicas). ``dp``, ``edp`` and ``precision_spec``
    (the resolved ``Precision``) are derived.

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
    use_precision_aware_optimizer: bool | None = None
    main_grads_dtype: str | None = None
    main_params_dtype: str | None = None
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    grad_reduce_in_bf16: bool | None = None
    store_param_remainders: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    num_distributed_optimizer_instances: int = 1
    dp: int = field(init=False)
    edp: int = field(init=False)
    precision_spec: Precision = field(init=False)

    def __post_init__(self) -> None:
        for flag, value in (("--world-size", self.world_size), ("--tp", self.tp),
                            ("--cp", self.cp), ("--ep", self.ep), ("--etp", self.etp),
                            ("--pp", self.pp), ("--vpp", self.vpp)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TracememError(f"{flag} {value!r} must be a positive integer")
        if not isinstance(self.sp, bool):
            raise TracememError(f"sp={self.sp!r} must be True or False")
        if self.sp and self.tp == 1:
            raise TracememError("--sp needs --tp > 1 (sequence parallelism shards activations "
                                "across the tensor-parallel group); drop --sp or raise --tp")
        if self.etp > 1 and self.ep == 1:
            raise TracememError(f"--etp {self.etp} needs --ep > 1; set --ep or use --etp 1")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise TracememError(f"--zero {self.zero!r} is invalid; choose 0, 1, 2 or 3")
        object.__setattr__(self, "precision_spec", resolve_precision(
            self.precision, self.zero,
            use_precision_aware_optimizer=self.use_precision_aware_optimizer,
            main_grads_dtype=self.main_grads_dtype, main_params_dtype=self.main_params_dtype,
            exp_avg_dtype=self.exp_avg_dtype, exp_avg_sq_dtype=self.exp_avg_sq_dtype,
            grad_reduce_in_bf16=self.grad_reduce_in_bf16,
            store_param_remainders=self.store_param_remainders,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion))
        if self.plan not in PLANS:
            raise TracememError(f"--plan {self.plan!r} is invalid; choose one of "
                                f"{', '.join(PLANS)}")
        dense = self.tp * self.cp * self.pp
        expert = self.etp * self.ep * self.pp
        if self.world_size % dense:
            raise TracememError(
                f"--world-size {self.world_size} is not a multiple of tp({self.tp}) * "
                f"cp({self.cp}) * pp({self.pp}) = {dense}; DP would not be an integer; "
                f"{_world_hint(self.world_size, dense, expert, self.pp)}")
        if self.world_size % expert:
            raise TracememError(
                f"--world-size {self.world_size} is not a multiple of etp({self.etp}) * "
                f"ep({self.ep}) * pp({self.pp}) = {expert}; EDP would not be an integer; "
                f"{_world_hint(self.world_size, dense, expert, self.pp)}")
        object.__setattr__(self, "dp", self.world_size // dense)
        object.__setattr__(self, "edp", self.world_size // expert)
        self._check_optimizer_instances()

    def _check_optimizer_instances(self) -> None:
        n = self.num_distributed_optimizer_instances
        flag = "--num-distributed-optimizer-instances"
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise TracememError(f"{flag} {n!r} must be a positive integer")
        if n == 1:
            return
        from tracemem.precision import FSDP2_RECIPES

        hsdp = self.zero == 3 and self.precision in FSDP2_RECIPES  # torchtitan's HSDP
        if self.zero == 0:
            raise TracememError(
                f"{flag} {n} needs the distributed optimizer (Megatron-LM d98e8a6 "
                f"distributed_data_parallel.py: 'Partial DistOpt cannot be used without "
                f"DistOpt'); use --zero 1 or {flag} 1")
        if self.zero in (2, 3) and not hsdp:
            raise TracememError(
                f"{flag} {n} with --zero {self.zero} is Megatron-FSDP's HSDP "
                f"(megatron/core/distributed/fsdp/mcore_fsdp_adapter.py: enable_hsdp), not "
                f"modelled yet; use --zero 1 (the distributed optimizer) or "
                f"{flag} 1")
        for name, size in (("DP x CP", self.dp_cp), ("EDP", self.edp)):
            if size % n:
                raise TracememError(
                    f"{flag} {n} must divide {name} ({size}) (Megatron-LM d98e8a6 "
                    f"parallel_state.py initialize_model_parallel: \"Data parallel size should "
                    f"be divisible by partial DistOpt shard factor\"); try "
                    f"{divisors_hint(math.gcd(self.dp_cp, self.edp))}")

    @property
    def dp_cp(self) -> int:
        """DP x CP: the group that shards dense optimizer states, gradients and parameters."""
        return self.dp * self.cp

    def group_size(self, group: str) -> int:
        """The size of ``group`` (a ``GROUPS`` key) in this layout."""
        return {"dp_cp": self.dp_cp, "edp": self.edp}[group]

    def intra_group_size(self, group: str) -> int:
        """The size of ``group``'s intra-instance part: ``group_size`` divided by
        ``num_distributed_optimizer_instances`` (``GROUPS``), the group the distributed
        optimizer and its DDP buffers shard over."""
        return self.group_size(group) // self.num_distributed_optimizer_instances

    def shards(self, quantity: str, kind: str) -> int:
        """How many ways this layout's ZeRO stage splits ``quantity`` of ``kind`` parameters
        (``SHARDING``): the group's size (ZeRO 1's rows: its intra-instance part), or 1 below
        the rule's ZeRO stage."""
        rule = sharding_rule(quantity, kind)
        if self.zero < rule.zero:
            return 1
        # ZeRO 3 with replicas is torchtitan's HSDP (the fsdp2 recipe only,
        # _check_optimizer_instances): every quantity sharded within a replica
        return (self.intra_group_size(rule.group) if rule.zero == 1 or self.zero == 3
                else self.group_size(rule.group))

    @property
    def num_virtual_stages(self) -> int:
        """pp * vpp model chunks."""
        return self.pp * self.vpp

    @classmethod
    def create(cls, model_cfg, *, world_size: int, pp_layout: tuple[int, ...] | None = None,
               pp_first_stage_layers: int | None = None,
               pp_last_stage_layers: int | None = None,
               account_for_embedding_in_pipeline_split: bool = False,
               account_for_loss_in_pipeline_split: bool = False, **degrees) -> ParallelConfig:
        """A validated layout for ``model_cfg`` (a ``modeling.ModelConfig``).

        ``pp_layout`` gives layers per virtual stage; or ``pp_first_stage_layers`` /
        ``pp_last_stage_layers`` (Megatron's ``--decoder-first/last-pipeline-num-layers``) fix
        the ends and split the rest evenly; or, with none of them, an even split, where
        Megatron's ``--account-for-embedding-in-pipeline-split`` /
        ``--account-for-loss-in-pipeline-split`` count the embedding / the loss as one more
        layer of the first / last virtual stage (megatron/core/transformer/transformer_block.py
        ``get_num_layers_to_build``: (layers + 1 + 1) split evenly over pp * vpp, the first
        virtual stage builds one layer fewer, the last one fewer).

        Raises:
            TracememError: see the class docstring; also TP not dividing the attention heads,
                EP not dividing the routed experts, more stages than layers, a layout that does
                not sum to the layer count.
        """
        valid = [f.name for f in fields(cls) if f.init and f.name not in ("world_size",
                                                                          "pp_layout")]
        unknown = sorted(set(degrees) - set(valid))
        if unknown:
            raise TracememError(
                f"ParallelConfig.create: unknown keyword {unknown[0]!r}; valid: world_size, "
                f"{', '.join(valid)}, pp_layout, pp_first_stage_layers, pp_last_stage_layers")
        tp = degrees.get("tp", 1)
        heads = getattr(model_cfg, "num_attention_heads", None)
        if type(tp) is int and tp > 0 and type(heads) is int and heads % tp:
            # before the world size's multiples: no world size makes this TP valid; the
            # suggestions divide the world size too, where some do
            raise TracememError(f"--tp {tp} must divide num_attention_heads ({heads}); "
                                f"try {divisors_hint(heads, also=world_size)}")
        pp, vpp = degrees.get("pp", 1), degrees.get("vpp", 1)
        layers = getattr(model_cfg, "num_layers", None)
        accounted = account_for_embedding_in_pipeline_split or \
            account_for_loss_in_pipeline_split
        if all(type(v) is int and v > 0 for v in (pp, vpp)) and type(layers) is int \
                and pp_layout is None and not accounted and pp * vpp > layers:
            # before the world size's multiples too: no world size places more stages than
            # layers, so a world size suggested for this PP would only lead here (the
            # embedding and the loss, when counted as layers, are _accounted_layout's)
            raise TracememError(f"pp * vpp = {pp * vpp} stages is more than the model's "
                                f"{layers} layers; lower --pp or --vpp so that pp * vpp <= "
                                f"{layers}")
        probe = cls(world_size=world_size, **degrees)  # degree checks first
        if account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split:
            layout = _accounted_layout(
                model_cfg.num_layers, probe.pp, probe.vpp, pp_layout, pp_first_stage_layers,
                pp_last_stage_layers, bool(account_for_embedding_in_pipeline_split),
                bool(account_for_loss_in_pipeline_split))
        else:
            layout = _layout(model_cfg.num_layers, probe.num_virtual_stages, pp_layout,
                             pp_first_stage_layers, pp_last_stage_layers, probe.vpp)
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
                                f"try {divisors_hint(heads, also=self.world_size)}")
        groups = model_cfg.num_key_value_heads
        if model_cfg.attention == "gqa" and groups % self.tp:
            # Megatron-Core d98e8a6 (attention.py Attention.__init__) also runs fewer query
            # groups than TP by all-gathering linear_qkv's output; tracemem does not model it
            raise TracememError(f"--tp {self.tp} must divide num_key_value_heads ({groups}): "
                                f"Megatron splits the query groups over TP; try "
                                f"{divisors_hint(groups)}")
        experts = model_cfg.num_routed_experts
        if not experts and (self.ep > 1 or self.etp > 1):
            raise TracememError(f"--ep {self.ep} --etp {self.etp}: {model_cfg.name} is dense "
                                f"(no routed experts); use --ep 1 --etp 1")
        if experts % self.ep:
            raise TracememError(f"--ep {self.ep} must divide n_routed_experts ({experts}); "
                                f"try {divisors_hint(experts)}")
        inter = model_cfg.moe_intermediate_size
        if inter % self.etp:
            raise TracememError(f"--etp {self.etp} must divide moe_intermediate_size ({inter}); "
                                f"try {divisors_hint(inter)}")
        sizes = ["intermediate_size", "moe_intermediate_size", "hidden_size"]
        if model_cfg.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert
            sizes.append("shared_expert_intermediate_size")
        if self.plan == "paper-2502.07846":  # no vocabulary padding under the paper's plan
            sizes.append("vocab_size")
        for name in sizes:
            size = getattr(model_cfg, name)
            if size % self.tp:
                raise TracememError(f"--tp {self.tp} must divide {name} ({size}); "
                                    f"try {divisors_hint(size)}")
        if sum(self.pp_layout) != model_cfg.num_layers:
            raise TracememError(
                f"--pp-layout sums to {sum(self.pp_layout)} layers; the model has "
                f"{model_cfg.num_layers}")

    def stage_of(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank`` (TP, CP and DP vary faster than PP).

        Raises:
            TracememError: ``rank`` outside [0, world_size).
        """
        if isinstance(rank, bool) or not isinstance(rank, int) \
                or not 0 <= rank < self.world_size:
            raise TracememError(f"rank {rank!r} is outside [0, {self.world_size})")
        return rank // (self.world_size // self.pp)

    def layers_of_stage(self, stage: int, placement=None) -> list[list[int]]:
        """Global layer numbers of pipeline rank ``stage``, one list per model chunk (VPP:
        chunk c of rank p is virtual stage c * pp + p, as in Megatron's interleaved schedule;
        or the chunks a ``tracemem.schedules.Placement`` puts there: V, bidirectional)."""
        starts = [sum(self.pp_layout[:v]) for v in range(self.num_virtual_stages)]
        chunks = (placement.chunks_of(stage) if placement is not None
                  else range(stage, self.num_virtual_stages, self.pp))
        return [list(range(starts[v], starts[v] + self.pp_layout[v])) for v in chunks]


def _accounted_layout(num_layers: int, pp: int, vpp: int, layout, first, last,
                      embedding: bool, loss: bool) -> tuple[int, ...]:
    """Megatron's ``get_num_layers_to_build`` with the embedding and / or loss counted as a
    layer: (num_layers + embedding + loss) must divide by pp and then by vpp."""
    flags = " / ".join(f for f, on in (("--account-for-embedding-in-pipeline-split", embedding),
                                       ("--account-for-loss-in-pipeline-split", loss)) if on)
    if layout is not None or first is not None or last is not None:
        raise TracememError(f"{flags} apply to an even split; give them without --pp-layout "
                            f"or --pp-first-stage-layers / --pp-last-stage-layers")
    total = num_layers + embedding + loss
    if total % pp or (total // pp) % vpp:
        raise TracememError(f"{flags}: {num_layers} layers + {embedding + loss} = {total} must "
                            f"divide by pp ({pp}) and then by vpp ({vpp}), as Megatron-LM "
                            f"asserts")
    per = total // (pp * vpp)
    layout = [per] * (pp * vpp)
    layout[0] -= embedding
    layout[-1] -= loss
    if min(layout) < 0:
        raise TracememError(f"{flags}: {per} layer(s) per virtual stage leave none for the "
                            f"embedding or loss; lower --pp or --vpp")
    return tuple(layout)


def _layout(num_layers: int, stages: int, layout, first, last, vpp: int = 1
            ) -> tuple[int, ...]:
    if layout is not None:
        layout = tuple(layout)
        if first is not None or last is not None:
            raise TracememError("give either --pp-layout or --pp-first-stage-layers / "
                                "--pp-last-stage-layers, not both")
        if not layout or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                             for n in layout):
            raise TracememError(f"--pp-layout {layout!r} is invalid; it needs one non-negative "
                                f"integer per virtual pipeline stage")
        if len(layout) != stages:
            raise TracememError(f"--pp-layout has {_count(len(layout), 'entry', 'entries')}; it "
                                f"needs one per "
                                f"virtual pipeline stage, pp * vpp = {stages}; try "
                                f"{_layout_flags(num_layers, stages, vpp)}")
        if sum(layout) != num_layers:
            raise TracememError(f"--pp-layout sums to {_count(sum(layout), 'layer')}; the "
                                f"model has {num_layers}; try "
                                f"{_layout_flags(num_layers, stages, vpp)}")
        return layout
    if stages > num_layers:
        raise TracememError(f"pp * vpp = {stages} stages is more than the model's {num_layers} "
                            f"layers; lower --pp or --vpp so that pp * vpp <= {num_layers}")
    if first is not None or last is not None:
        return _ends_layout(num_layers, stages, first, last, vpp)
    if num_layers % stages:
        raise TracememError(
            f"{num_layers} layers do not divide into pp * vpp = {stages} stages; give "
            f"--pp-layout (e.g. {_suggest(num_layers, stages)})"
            + (f" or --pp-first-stage-layers / --pp-last-stage-layers (e.g. "
               f"{_ends_flags(num_layers, stages)})" if vpp == 1 else
               " (--pp-first-stage-layers / --pp-last-stage-layers do not apply with --vpp > 1)"))
    return (num_layers // stages,) * stages


def _ends_layout(num_layers: int, stages: int, first, last, vpp: int) -> tuple[int, ...]:
    """Megatron's uneven split (``get_num_layers_to_build``): the given ends, and the other
    stages share the remaining layers evenly."""
    given = " / ".join(flag for flag, value in (("--pp-first-stage-layers", first),
                                                ("--pp-last-stage-layers", last))
                       if value is not None)
    if vpp > 1:
        verb = "is" if first is None or last is None else "are"
        raise TracememError(f"{given} with --vpp > 1 {verb} not supported; give --pp-layout "
                            f"with one entry per virtual stage instead, e.g. --pp-layout "
                            f"{_suggest(num_layers, stages, first, last)}")
    if stages < 2:
        raise TracememError("--pp-first-stage-layers / --pp-last-stage-layers need --pp 2 or "
                            "more; drop them (one stage holds every layer) or raise --pp")
    for flag, value in (("--pp-first-stage-layers", first), ("--pp-last-stage-layers", last)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= num_layers):
            raise TracememError(f"{flag} {value!r} must be between 0 and the model's "
                                f"{num_layers} layers; e.g. {_ends_flags(num_layers, stages)}")
    fixed = (first or 0) + (last or 0)
    others = stages - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (others and rest % others) or (not others and rest):
        given_values = " and ".join(f"{flag} {value}" for flag, value in (
            ("--pp-first-stage-layers", first), ("--pp-last-stage-layers", last))
            if value is not None)
        leave = "leave" if first is not None and last is not None else "leaves"
        problem = (f"add up to more than the model's {num_layers} layers" if rest < 0 else
                   f"{leave} {_count(rest, 'layer')} for {_count(others, 'other stage')}, "
                   f"which do not divide evenly" if others else
                   f"{leave} {_count(rest, 'layer')} on no stage")
        raise TracememError(f"{given_values} {problem}; try "
                            f"{_ends_flags(num_layers, stages, first, last)} or --pp-layout "
                            f"{_suggest(num_layers, stages, first, last)}")
    per = rest // others if others else 0
    return ((per if first is None else first), *[per] * (stages - 2),
            (per if last is None else last))


def _suggest(num_layers: int, stages: int, first: int | None = None,
             last: int | None = None) -> str:
    """A ``--pp-layout`` for ``num_layers`` over ``stages`` (virtual) stages that
    ``parse_layout`` and ``_layout`` accept: the given ends (when they fit) and the rest as even
    as possible, ``4*15,1`` style when that fills every stage."""
    return format_layout(suggest_layout(num_layers, stages, first, last))


def suggest_layout(num_layers: int, stages: int, first: int | None = None,
                   last: int | None = None) -> tuple[int, ...]:
    """Layers per stage for ``num_layers`` over ``stages`` >= 1 stages, every entry >= 0 and
    the sum ``num_layers``: ``first`` / ``last`` kept when they leave enough layers, the
    others as even as possible (the larger ones first, so the last stage, which also holds
    the head and loss, gets fewer)."""
    ends = [value if _is_layers(value, num_layers) and stages > 1 else None
            for value in (first, last)]
    if sum(e or 0 for e in ends) > num_layers or (stages == 2 and None not in ends):
        ends = [None, None]
    middle = stages - sum(e is not None for e in ends)
    rest = num_layers - sum(e or 0 for e in ends)
    per = -(-rest // middle)
    full, remainder = divmod(rest, per) if per else (middle, 0)
    if full + (remainder > 0) == middle:
        body = [per] * full + ([remainder] if remainder else [])
    else:
        low, high = divmod(rest, middle)
        body = [low + 1] * high + [low] * (middle - high)
    return tuple(([ends[0]] if ends[0] is not None else []) + body
                 + ([ends[1]] if ends[1] is not None else []))


def format_layout(layout: tuple[int, ...]) -> str:
    """``(4, 4, 4, 1)`` -> ``"4*3,1"`` (the ``--pp-layout`` syntax of ``parse_layout``)."""
    parts: list[list[int]] = []
    for n in layout:
        if parts and parts[-1][0] == n:
            parts[-1][1] += 1
        else:
            parts.append([n, 1])
    return ",".join(f"{n}*{k}" if k > 1 else str(n) for n, k in parts)


def suggest_ends(num_layers: int, stages: int, first: int | None = None,
                 last: int | None = None) -> tuple[int, int]:
    """``(first, last)`` stage layers that ``_ends_layout`` accepts for 2 <= ``stages`` <=
    ``num_layers``: the given ``last`` kept and the first stage fixed, else the given ``first``
    kept, else middle stages of ceil(layers / stages) and what is left on the ends (61 layers
    over 16 stages: 4 and 1, DeepSeek-V3's layout)."""
    middle = stages - 2
    if middle == 0:
        for kept, flip in ((last, True), (first, False)):
            if _is_layers(kept, num_layers):
                pair = (num_layers - kept, kept)
                return pair if flip else pair[::-1]
        return num_layers - num_layers // 2, num_layers // 2
    if _is_layers(last, num_layers):
        return (num_layers - last) % middle, last
    if _is_layers(first, num_layers):
        return first, (num_layers - first) % middle
    per = -(-num_layers // stages)
    rest = num_layers - per * middle
    if rest < 0:
        per = num_layers // stages
        rest = num_layers - per * middle
    return min(per, rest), rest - min(per, rest)


def _is_layers(value, num_layers: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= num_layers


def _ends_flags(num_layers: int, stages: int, first: int | None = None,
                last: int | None = None) -> str:
    f, l = suggest_ends(num_layers, stages, first, last)
    return f"--pp-first-stage-layers {f} --pp-last-stage-layers {l}"


def _layout_flags(num_layers: int, stages: int, vpp: int) -> str:
    flags = f"--pp-layout {_suggest(num_layers, stages)}"
    if vpp == 1 and stages >= 2 and num_layers >= stages and num_layers % stages:
        flags += f" or {_ends_flags(num_layers, stages)}"
    elif not num_layers % stages:
        flags += " or no layout flag (an even split)"
    return flags
