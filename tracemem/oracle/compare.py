"""``tracemem validate --against megatron-core``: Megatron-Core's own model, with tracemem's
``megatron-te`` kernels as its leaves, held against tracemem's ``build_rank`` layer by layer.

For one small DeepSeek-architecture config (``oracle_model_config``: deepseek-tiny with 3
layers, the first dense, MoE layers with a shared expert, no MTP) and one layout
(``OracleCase``: TP with or without SP, EP, ETP, recompute), both models run one microbatch's
decoder layers (a middle pipeline stage: input received, output gradient received) forward
and backward on the meta device under ``MemoryTracer``, rank 0 of the layout:

- Megatron-Core 0.16.1: ``GPTModel(pre_process=False, post_process=False)`` built from
  ``tracemem.oracle.megatron_spec.decoder_layer_specs`` under the patches of
  ``tracemem.oracle.megatron_patches`` and a fake process group;
- tracemem: ``modeling.parallel.build_rank(..., kernels="megatron-te")``, its decoder layers.

Per layer (``LayerBytes``): the bytes its forward made that are still alive when the forward
ends (kept for backward), its forward peak and its backward peak (each above what was alive
when the layer's first event ran), and its parameter bytes. A difference is itemised by
storage (``LayerDiff``): the storages kept by one side without a same-size, same-dtype
counterpart on the other.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tracemem.categories import Phase
from tracemem.errors import TracememError

__all__ = ["OracleCase", "ORACLE_CASES", "LayerBytes", "LayerDiff", "CaseResult",
           "oracle_model_config", "run_case", "format_results"]

RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class OracleCase:
    """One layout. ``recompute``: "none", "full" (Megatron ``--recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1``) or "selective" (``--recompute-
    modules`` ``modules``). b = 1 (``micro_batch_size``), ``seq_length`` tokens."""

    tp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    recompute: str = "none"
    modules: tuple[str, ...] = ()
    seq_length: int = 16

    @property
    def name(self) -> str:
        rec = {"none": "", "full": ", full recompute"}.get(
            self.recompute, f", selective {'+'.join(self.modules)}")
        return (f"TP{self.tp}{'+SP' if self.sp else ''} EP{self.ep} ETP{self.etp}{rec}")

    @property
    def world_size(self) -> int:
        return math.lcm(self.tp, self.ep * self.etp)


ORACLE_CASES: tuple[OracleCase, ...] = (
    OracleCase(),
    OracleCase(tp=2, sp=True),
    OracleCase(ep=4),
    OracleCase(ep=8),
    OracleCase(tp=2, sp=True, ep=4),
    OracleCase(tp=2, sp=True, ep=8),
    OracleCase(ep=4, etp=2),
    OracleCase(tp=2, sp=True, ep=4, etp=2),
    OracleCase(tp=2, sp=True, ep=4, recompute="full"),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("core_attn",)),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("mla_up_proj",)),
)


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer on one side, bytes: ``kept`` (made in its forward, alive at the end
    of the forward), ``forward_peak`` / ``backward_peak`` (above what was alive before the
    layer's first event of that pass), ``params``; ``kept_storages``: (nbytes, dtype, shape,
    module, op) of each kept storage."""

    kept: int
    forward_peak: int
    backward_peak: int
    params: int
    kept_storages: tuple = ()
    forward_peak_storages: tuple = ()
    backward_peak_storages: tuple = ()


    @property
    def totals(self) -> tuple[int, int, int, int]:
        return self.kept, self.forward_peak, self.backward_peak, self.params


@dataclass(frozen=True)
class LayerDiff:
    """Storages kept by one side only (matched by bytes and dtype)."""

    only_megatron: tuple = ()
    only_tracemem: tuple = ()


@dataclass
class CaseResult:
    case: OracleCase
    megatron: dict[int, LayerBytes] = field(default_factory=dict)
    tracemem: dict[int, LayerBytes] = field(default_factory=dict)

    def diff(self, layer: int) -> LayerDiff:
        """The kept storages of ``layer`` without a counterpart of the same bytes and dtype
        on the other side (made by the same aten op where one exists)."""
        only_m = list(self.megatron[layer].kept_storages)
        only_t = list(self.tracemem[layer].kept_storages)
        for key in (lambda s: (s[0], s[1], s[4]), lambda s: (s[0], s[1])):
            for item in list(only_m):
                match = next((t for t in only_t if key(t) == key(item)), None)
                if match is not None:
                    only_m.remove(item)
                    only_t.remove(match)
        return LayerDiff(tuple(only_m), tuple(only_t))

    @property
    def equal(self) -> bool:
        return all(self.megatron[i].totals == self.tracemem[i].totals for i in self.megatron)


def oracle_model_config(num_layers: int = 3):
    """deepseek-tiny (h 64, 4 heads, MLA with q LoRA, 8 routed experts top-2 in 4 groups, one
    shared expert, sigmoid router with correction bias) with ``num_layers`` layers, the first
    dense, no MTP, bf16."""
    from modeling import load_config
    cfg = load_config("deepseek-tiny")
    return dataclasses.replace(cfg, num_layers=num_layers, first_k_dense_replace=1,
                               num_mtp_modules=0, dtype="bfloat16")


def _megatron_config(cfg, case: OracleCase):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    recompute = {}
    if case.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    elif case.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=list(case.modules))
    return MLATransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.intermediate_size,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.sp,
        expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.etp,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_type="rope", rotary_base=10000,
        rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True,
        multi_latent_attention=True, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=True,
        num_moe_experts=cfg.num_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.num_shared_experts * cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)],
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_router_score_function=cfg.scoring_func,
        moe_router_enable_expert_bias=cfg.has_correction_bias,
        moe_router_num_groups=cfg.num_expert_groups, moe_router_group_topk=cfg.topk_group,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_router_dtype="fp32",
        moe_shared_expert_overlap=True, moe_permute_fusion=True, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        bf16=True, params_dtype=torch.bfloat16, perform_initialization=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=True, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, **recompute)


def _layer_bytes(tracer, layer_of: Callable[[str], int | None], params: dict[int, int],
                 end_forward: int) -> dict[int, LayerBytes]:
    events = tracer.events
    spans: dict[tuple[int, str], list[int]] = {}
    for e in events:  # a layer's pass spans its first to its last allocation (a free names
        # the module that made the storage, which may have run long before)
        if e.action != "alloc":
            continue
        layer = layer_of(e.module) if e.index > end_forward or e.phase is Phase.FORWARD \
            else None
        if layer is None:
            continue
        key = (layer, "f" if e.index <= end_forward else "b")
        span = spans.setdefault(key, [e.index, e.index])
        span[1] = e.index

    def peak(span):
        first, last = span
        before = events[first - 1].total_bytes if first else 0
        return max(events[i].total_bytes for i in range(first, last + 1)) - before

    def peak_set(span):
        first, last = span
        at = max(range(first, last + 1), key=lambda i: events[i].total_bytes)
        old = {i.storage_id for i in tracer.live_at(first - 1)}
        return tuple(sorted(((i.nbytes, str(i.dtype).removeprefix("torch."), i.shape,
                              i.module, i.op) for i in tracer.live_at(at)
                             if i.storage_id not in old), key=lambda s: (-s[0], s[3])))

    live = tracer.live_at(end_forward)
    out = {}
    for layer in sorted({k[0] for k in spans}):
        kept = tuple(sorted(((i.nbytes, str(i.dtype).removeprefix("torch."), i.shape, i.module,
                              i.op) for i in live
                             if i.phase is Phase.FORWARD and layer_of(i.module) == layer),
                            key=lambda s: (-s[0], s[3])))
        out[layer] = LayerBytes(sum(s[0] for s in kept), peak(spans[(layer, "f")]),
                                peak(spans[(layer, "b")]) if (layer, "b") in spans else 0,
                                params.get(layer, 0), kept,
                                peak_set(spans[(layer, "f")]),
                                peak_set(spans[(layer, "b")]) if (layer, "b") in spans else ())
    return out


def _trace(model, run, x_shape, layer_of, param_layer_of, state=()) -> dict[int, LayerBytes]:
    from modeling.parallel.pp import recv_backward, recv_forward
    from tracemem.tracer import MemoryTracer

    params: dict[int, int] = {}
    for name, p in model.named_parameters():
        layer = param_layer_of(name)
        if layer is not None:
            params[layer] = params.get(layer, 0) + p.numel() * p.element_size()
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model, list(state))
    with tracer, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # c10d's deprecated collective names
        x = recv_forward(x_shape, torch.bfloat16)
        out = run(x)
        end_forward = len(tracer.events) - 1
        grad = recv_backward(tuple(out.shape), torch.bfloat16)
        out.backward(grad)
        del out, grad, x
    return _layer_bytes(tracer, layer_of, params, end_forward)


def _layer_index(prefix: str, offset: int = 0):
    def of(module: str) -> int | None:
        if not module.startswith(prefix):
            return None
        head = module[len(prefix):].split(".", 1)[0]
        return int(head) + offset if head.isdigit() else None
    return of


def _run_tracemem(cfg, case: OracleCase, routing) -> dict[int, LayerBytes]:
    from modeling.parallel import build_rank
    from tracemem.parallel import ParallelConfig

    par = ParallelConfig.create(cfg, world_size=case.world_size, tp=case.tp, sp=case.sp,
                                ep=case.ep, etp=case.etp)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels="megatron-te")
    for block in model.layers.values():
        block.set_recompute(case.recompute, frozenset(case.modules))
    layers = [model.layers[str(i)] for i in range(cfg.num_layers)]

    def run(x):
        for layer in layers:
            x = layer(x, routing)
        return x

    local = case.seq_length // (case.tp if case.sp else 1)
    return _trace(model, run, (1, local, cfg.hidden_size), _layer_index("layers."),
                  _layer_index("layers."))


def _run_megatron(cfg, case: OracleCase, routing) -> dict[int, LayerBytes]:
    # megatron-core warns at import that TE and Apex are absent (the point here) and about
    # deprecated defaults it sets itself; the oracle prints nothing on stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _run_megatron_quietly(cfg, case, routing)


def _run_megatron_quietly(cfg, case: OracleCase, routing) -> dict[int, LayerBytes]:
    from tracemem.oracle import megatron_patches as patches
    from tracemem.oracle.megatron_spec import decoder_layer_specs

    patches.require_megatron()
    from megatron.core.models.gpt.gpt_model import GPTModel
    with patches.fake_process_groups(world_size=case.world_size, tp=case.tp, ep=case.ep,
                                     etp=case.etp), patches.applied():
        config = _megatron_config(cfg, case)
        patches.set_routing(routing)
        with torch.device("meta"):
            model = GPTModel(config, decoder_layer_specs(config), vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.max_position_embeddings,
                             pre_process=False, post_process=False,
                             position_embedding_type="none")
        for module in model.modules():
            if hasattr(module, "token_dispatcher"):  # the routing model's layer number
                module.token_dispatcher.tracemem_layer = module.layer_number - 1

        def run(x):
            model.set_input_tensor(x)
            return model(input_ids=None, position_ids=None, attention_mask=None)

        # RotaryEmbedding.inv_freq is a plain attribute made at construction, not a buffer:
        # module state, as tracemem's MLA.inv_freq buffer is
        state = [m.inv_freq for m in model.modules()
                 if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
        local = case.seq_length // (case.tp if case.sp else 1)
        try:
            return _trace(model, run, (local, 1, cfg.hidden_size),
                          _layer_index("decoder.layers."), _layer_index("decoder.layers."),
                          state)
        finally:
            patches.set_routing(None)


def run_case(case: OracleCase, cfg=None, routing=None) -> CaseResult:
    """Trace both models for ``case`` (default config ``oracle_model_config()``, balanced
    routing).

    Raises:
        TracememError: megatron-core missing or not the pinned version; a bad layout.
    """
    from modeling.common.routing import Balanced

    if case.recompute not in RECOMPUTE:
        raise TracememError(f"recompute {case.recompute!r} is invalid; choose one of "
                            f"{', '.join(RECOMPUTE)}")
    cfg = cfg or oracle_model_config()
    routing = routing or Balanced()
    result = CaseResult(case)
    result.megatron = _run_megatron(cfg, case, routing)
    result.tracemem = _run_tracemem(cfg, case, routing)
    return result


def format_results(results: list[CaseResult]) -> str:
    """One row per (case, layer): Megatron-Core's and tracemem's bytes and their difference,
    then every kept storage that differs, by layer."""
    from tabulate import tabulate

    rows, notes = [], []
    for r in results:
        for i in sorted(r.megatron):
            m, t = r.megatron[i], r.tracemem.get(i, LayerBytes(0, 0, 0, 0))
            cells = []
            for attr in ("kept", "forward_peak", "backward_peak", "params"):
                a, b = getattr(m, attr), getattr(t, attr)
                cells.append(f"{a:,}" if a == b else f"{a:,} / {b:,}")
            rows.append([r.case.name, i, *cells])
            d = r.diff(i)
            for side, items in (("Megatron-Core only", d.only_megatron),
                                ("tracemem only", d.only_tracemem)):
                for nbytes, dtype, shape, module, op in items:
                    notes.append(f"- {r.case.name}, layer {i}, {side}: {nbytes:,} B {dtype} "
                                 f"{list(shape)} made by {op} in {module}")
    table = tabulate(rows, headers=["layout", "layer", "kept B", "forward peak B",
                                    "backward peak B", "params B"],
                     disable_numparse=True, colalign=("left", "right", "right", "right",
                                                      "right", "right"))
    legend = ("Cells: equal bytes, or 'Megatron-Core / tracemem'. Rank 0 of each layout, b=1, "
              "s=16, deepseek-tiny with 3 layers (layer 0 dense), megatron-te kernels.")
    return "\n".join([table, "", legend] + (["", "Kept storages that differ:", *notes]
                                             if notes else []))
