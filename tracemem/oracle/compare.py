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

``OracleCase(whole=True)`` runs the whole model instead, from token ids and labels to the
loss (``GPTModel(pre_process=True, post_process=True)``; tracemem's ``megatron-te`` with
``cross_entropy_fusion="none"``, Megatron-Core's default loss, or with
``cross_entropy="native"`` ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`` on
both sides: ``fusions/fused_cross_entropy.py``, whose ``@jit_fuser`` bodies run eagerly under
the tracer, a residue row), with two more parts: -1 the
embedding and ``num_layers`` the output part (final norm, output layer, loss);
``mtp=True`` adds one MTP layer (``--mtp-num-layers 1``: Megatron-Core's
``MultiTokenPredictionBlock`` from ``get_gpt_mtp_block_spec_for_backend`` with the oracle's
leaves; tracemem's ``Transformer._megatron_mtp_loss``), part ``num_layers + 1``, which also
takes the embedding's storages made after the decoder began (the MTP layer's embedding call).

Every known difference is a row of ``RESIDUE`` (tensor, where, bytes as formulas of the
layout, storages, reason); ``unexplained`` lists what the rows do not explain and
``run_command`` (``tracemem validate --against megatron-core``, with the static cases of
``tracemem.oracle.static_oracle``) returns exit code 1 when anything is unexplained.
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
           "ResidueRule", "Residue", "RESIDUE", "residue", "unexplained",
           "oracle_model_config", "run_case", "format_results", "results_json", "run_command"]

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
    whole: bool = False  # the whole model: embedding, layers, final norm, output layer, loss
    shared_expert_overlap: bool = True  # --moe-shared-expert-overlap (off for shared_experts)
    mtp: bool = False  # with whole: one MTP layer (--mtp-num-layers 1)
    # with whole: the loss (--cross-entropy-loss-fusion --cross-entropy-fusion-impl native:
    # "native"; Megatron-Core's default vocab_parallel_cross_entropy: "none")
    cross_entropy: str = "none"

    @property
    def name(self) -> str:
        rec = {"none": "", "full": ", full recompute"}.get(
            self.recompute, f", selective {'+'.join(self.modules)}")
        whole = (", whole model" + (" with MTP" if self.mtp else "")
                 + (f", {self.cross_entropy} fused cross entropy"
                    if self.cross_entropy != "none" else "")) if self.whole else ""
        overlap = "" if self.shared_expert_overlap else ", no shared-expert overlap"
        return (f"TP{self.tp}{'+SP' if self.sp else ''} EP{self.ep} ETP{self.etp}{rec}"
                f"{overlap}{whole}")

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
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("layernorm",)),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("mlp",)),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("moe",)),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("moe_act",)),
    OracleCase(tp=2, sp=True, ep=4, recompute="selective", modules=("shared_experts",),
               shared_expert_overlap=False),
    OracleCase(tp=2, sp=True, ep=4, etp=2, recompute="full"),
    OracleCase(whole=True, cross_entropy="native"),
    OracleCase(tp=2, sp=True, ep=4, whole=True, cross_entropy="native"),
    OracleCase(tp=2, sp=True, ep=4, whole=True, mtp=True),
    OracleCase(whole=True, mtp=True),
    OracleCase(whole=True),
    OracleCase(tp=2, sp=True, ep=4, whole=True),
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
    cfg: object = None  # the model config traced (None: oracle_model_config())
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

    @property
    def unexplained(self) -> list[str]:
        """Every difference of this layout that ``RESIDUE`` does not name (``unexplained``)."""
        return unexplained(self)


# ---------------------------------------------------------------------------- the residue
@dataclass(frozen=True)
class _Dims:
    """What the residue's bytes are made of, for one layout and layer: ``s`` tokens of the
    sequence, ``t`` tokens the layer's router sees on this rank (s / TP under SP), ``e``
    routed experts, ``d_r`` the RoPE head dim, ``n`` attention heads on this rank,
    ``qkv``: bytes of MLA's query, key and value ``[s, b, n, d]`` bf16 on this rank."""

    case: OracleCase
    layer: int
    moe: bool
    s: int
    t: int
    e: int
    d_r: int
    n: int
    qkv: int
    part: str = "layer"  # or, for the whole model, "embedding" / "output" (norm, head,
    # loss) / "mtp" (the MTP layer)
    h: int = 0  # hidden size
    vocab: int = 0  # the output layer's vocabulary on this rank (V / TP)


@dataclass(frozen=True)
class ResidueRule:
    """One row of ``RESIDUE``: a known difference, Megatron-Core minus tracemem, of each layer
    where ``applies``; ``kept``, ``forward_peak``, ``backward_peak`` (bytes) and ``storages``
    (the (bytes, dtype) of each kept storage only Megatron-Core has) as functions of the
    layer's ``_Dims``; ``reason`` cites the Megatron-Core source that makes it."""

    tensor: str
    where: str
    applies: Callable[[_Dims], bool]
    kept: Callable[[_Dims], int]
    forward_peak: Callable[[_Dims], int]
    backward_peak: Callable[[_Dims], int]
    storages: Callable[[_Dims], tuple]
    reason: str
    tracemem_storages: Callable[[_Dims], tuple] = lambda d: ()  # kept by tracemem only


@dataclass(frozen=True)
class Residue:
    """A ``ResidueRule`` evaluated for one layer of one layout: bytes and storages."""

    tensor: str
    layer: int
    kept: int
    forward_peak: int
    backward_peak: int
    storages: tuple
    reason: str
    tracemem_storages: tuple = ()


def _full(d: _Dims) -> bool:
    return d.case.recompute == "full"


def _selective(d: _Dims, module: str) -> bool:
    return d.case.recompute == "selective" and module in d.case.modules


def _moe_checkpointed(d: _Dims) -> bool:
    """The MoE layer runs inside a reentrant checkpoint (full recompute, or selective
    ``moe``): its forward is under ``no_grad`` and recomputed in backward."""
    return _full(d) or _selective(d, "moe")


# Megatron-Core 0.16.1's CheckpointWithoutOutput._recompute copies the recomputed outputs back
# into the discarded storages (resize_, copy_) while ctx.outputs still holds the recomputed
# ones (Megatron-LM d98e8a6 shares the storage instead, which tracemem follows,
# modeling.common.checkpoint). Under selective mla_up_proj the layer's backward-peak
# difference is read from the two traces (the MoE part's backward sets tracemem's peak on MoE
# layers): the one measured row of the table.
_MLA_UP_PROJ_RESTORE_BACKWARD = {0: 912, 1: 0, 2: 768}

RESIDUE: tuple[ResidueRule, ...] = (
    ResidueRule(
        "RoPE cache emb [s, 1, 1, d_r] fp32", "every layer (the MTP layer's too)",
        lambda d: d.part in ("layer", "mtp"),
        kept=lambda d: d.s * d.d_r * 4, forward_peak=lambda d: d.s * d.d_r * 4,
        backward_peak=lambda d: 0, storages=lambda d: ((d.s * d.d_r * 4, "float32"),),
        reason="models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.forward is "
               "@lru_cache(maxsize=32): each layer keeps its emb from its first forward on "
               "(persistent, reused by every later microbatch; tracemem does not count it)"),
    ResidueRule(
        "dispatcher probs [T, E] fp32", "MoE layers", lambda d: d.moe,
        kept=lambda d: d.t * d.e * 4, forward_peak=lambda d: 0,
        backward_peak=lambda d: -d.t * d.e * 4 if _moe_checkpointed(d) else 0,
        storages=lambda d: ((d.t * d.e * 4, "float32"),),
        reason="transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher."
               "dispatch_preprocess stores self.probs until the layer's next forward (across "
               "microbatches); alive at the forward peak on both sides; under full recompute "
               "the backward's recompute replaces it, freed before the backward peak. "
               "tracemem's trace drops it; its schedule replay holds it as the dispatcher "
               "does (MemoryTracer.retain, held against Megatron-Core's schedules by "
               "schedule_oracle)"),
    ResidueRule(
        "dispatcher routing_map [T, E] bool", "MoE layers", lambda d: d.moe,
        kept=lambda d: d.t * d.e, forward_peak=lambda d: d.t * d.e,
        backward_peak=lambda d: 0, storages=lambda d: ((d.t * d.e, "bool"),),
        reason="token_dispatcher.py dispatch_preprocess stores self.routing_map until the "
               "layer's next forward; alive at the forward peak (tracemem's trace frees it, "
               "its schedule replay holds it: MemoryTracer.retain); under full recompute the "
               "recomputed one replaces it"),
    ResidueRule(
        "dispatcher row-id map [T, 2E + 1] int32", "MoE layers, full or moe recompute",
        lambda d: d.moe and _moe_checkpointed(d),
        kept=lambda d: d.t * (2 * d.e + 1) * 4, forward_peak=lambda d: 0,
        backward_peak=lambda d: -d.t * (2 * d.e + 1) * 4,
        storages=lambda d: ((d.t * (2 * d.e + 1) * 4, "int32"),),
        reason="token_dispatcher.py self.reversed_local_input_permutation_mapping lives until "
               "the next forward; elsewhere the unpermute saves it on both sides, but full "
               "recompute's forward runs under no_grad (CheckpointFunction); the recompute "
               "replaces it before the backward peak (tracemem's schedule replay holds it: "
               "MemoryTracer.retain)"),
    ResidueRule(
        "recomputed outputs copied back while held (CheckpointWithoutOutput, 0.16.1)",
        "selective layernorm / mla_up_proj, backward",
        lambda d: _selective(d, "mla_up_proj") or (_selective(d, "layernorm") and d.moe),
        kept=lambda d: 0, forward_peak=lambda d: 0,
        backward_peak=lambda d: (_MLA_UP_PROJ_RESTORE_BACKWARD[d.layer]
                                 if _selective(d, "mla_up_proj") else d.t * d.h * 2),
        storages=lambda d: (),
        reason="tensor_parallel/random.py CheckpointWithoutOutput._recompute at megatron-core "
               "0.16.1 resizes the discarded outputs back and copies the recomputed values "
               "in while ctx.outputs still holds them (Megatron-LM d98e8a6 shares the "
               "storage: tracemem's modeling.common.checkpoint); layernorm: the MoE layers' "
               "pre-MLP norm output [T, h] bf16 twice at the backward peak; mla_up_proj: "
               "read from the traces (912, 0 and 768 B on layers 0, 1, 2)"),
    # the whole model (OracleCase.whole): b = 1
    ResidueRule(
        "VocabParallelEmbedding masked input [b, s] int64 and mask [b, s] bool",
        "embedding, TP > 1", lambda d: d.part == "embedding" and d.case.tp > 1,
        kept=lambda d: d.s * 9, forward_peak=lambda d: d.s * 9, backward_peak=lambda d: 0,
        storages=lambda d: ((d.s * 8, "int64"), (d.s, "bool")),
        reason="tensor_parallel/layers.py VocabParallelEmbedding.forward with TP > 1: "
               "masked_input = input_.clone() - vocab_start_index is saved by the embedding "
               "and input_mask by output_parallel[input_mask, :] = 0.0 (index_put_); "
               "tracemem's embedding (modeling.common.model Transformer.embed) saves the "
               "token ids only"),
    ResidueRule(
        "index_put_ backward: a masked copy of the embedding's gradient [b, s, h] bf16",
        "embedding, TP > 1, backward", lambda d: d.part == "embedding" and d.case.tp > 1,
        kept=lambda d: 0, forward_peak=lambda d: 0,
        backward_peak=lambda d: (2 * d.s * d.h - 2 * (d.s // d.case.tp if d.case.sp else d.s)
                                 * d.h - d.s),
        storages=lambda d: (),
        reason="the backward of output_parallel[input_mask, :] = 0.0 makes a zero-masked "
               "copy of the output gradient, alive during embedding_dense_backward; by "
               "then the SP-local gradient [b, s / TP, h] (all-gathered into it) and the "
               "mask are freed: + 2bsh - 2b(s / TP)h - bs"),
    ResidueRule(
        "the per-token loss [b, s] fp32 (tracemem: its mean, a scalar)", "output",
        lambda d: d.part == "output",
        kept=lambda d: d.s * 4 - 4, forward_peak=lambda d: 0,
        backward_peak=lambda d: -d.s * 4,
        storages=lambda d: ((d.s * 4, "float32"),),
        tracemem_storages=lambda d: ((4, "float32"),),
        reason="models/gpt/gpt_model.py GPTModel.forward returns compute_language_model_loss's "
               "per-token loss (the oracle backpropagates its sum, an expand); tracemem's "
               "loss kernel returns the mean (modeling.kernels.loss.megatron_cross_entropy), "
               "whose backward makes a [b, s] fp32 gradient"),
    ResidueRule(
        "vocab_parallel_cross_entropy's [s, b] fp32 temporaries at the forward peak",
        "output, Megatron-Core's default loss",
        lambda d: d.part == "output" and d.case.cross_entropy == "none",
        kept=lambda d: 0, forward_peak=lambda d: -2 * d.s * 4, backward_peak=lambda d: 0,
        storages=lambda d: (),
        reason="tensor_parallel/cross_entropy.py VocabParallelCrossEntropy: the output "
               "part's forward peak is at the predicted-logit gather (one [s*b] fp32 "
               "temporary alive); tracemem's _VocabParallelCrossEntropy peaks at the loss, "
               "holding sum_exp_logits, its log and the loss ([s, b] fp32 each): two more "
               "(modeling/kernels/loss.py; a fault of tracemem's, 2 x 4 B per token)"),
    ResidueRule(
        "the fused cross entropy's backward run eagerly: the target update in place on the "
        "softmax, with arange [N] int64 and 1 - target_mask [N] fp32 (tracemem: inductor's "
        "functionalised fp32 copy [N, V / TP])",
        "output, --cross-entropy-fusion-impl native, backward",
        lambda d: d.part == "output" and d.case.cross_entropy == "native",
        kept=lambda d: 0, forward_peak=lambda d: 0,
        backward_peak=lambda d: d.s * 8 + d.s * 4 - d.s * d.vocab * 4,
        storages=lambda d: (),
        reason="fusions/fused_cross_entropy.py calculate_gradients is @jit_fuser "
               "(torch.compile); torch 2.13 torch/_dynamo/convert_frame.py skips a frame while "
               "a TorchDispatchMode is on the stack (any_torch_dispatch_mode_on_stack), so "
               "under the oracle's tracer Megatron-Core runs it eagerly: "
               "prepare_gradient_calculation_operands' arange and 1 - target_mask, the "
               "index_put in place. tracemem's native kernel allocates what inductor's "
               "generated code does on a GPU (modeling/kernels/loss.py "
               "_FusedVocabParallelCrossEntropy: the index_put functionalised into an fp32 "
               "copy, the arange fused); N = b x s. The forward's buffers agree in bytes"),
    # the whole model with one MTP layer (OracleCase(whole=True, mtp=True)): b = 1
    ResidueRule(
        "position_ids [b, s] int64 rolled by the MTP layer", "MTP, forward",
        lambda d: d.part == "mtp",
        kept=lambda d: 0, forward_peak=lambda d: d.s * 8, backward_peak=lambda d: 0,
        storages=lambda d: (),
        reason="transformer/multi_token_prediction.py MultiTokenPredictionLayer._get_embeddings "
               "rolls the batch's position_ids (roll_tensor) beside the input ids and returns "
               "them with the hidden states; freed when MultiTokenPredictionBlock.forward "
               "returns. tracemem's MLA models have no position ids (no position embedding)"),
    ResidueRule(
        "the MTP layer's RoPE cache, dispatcher probs and routing map in the output part's span",
        "output, MTP", lambda d: d.part == "output" and d.case.mtp,
        kept=lambda d: 0, forward_peak=lambda d: d.s * d.d_r * 4 + d.t * d.e * 4 + d.t * d.e,
        backward_peak=lambda d: 0, storages=lambda d: (),
        reason="the rows above on the MTP part (its RoPE emb, self.probs and self.routing_map), "
               "counted again here: the output part's span runs from the decoder's final norm, "
               "before the MTP layer, to the main loss, so they are born in it and alive at its "
               "forward peak"),
    ResidueRule(
        "the MTP layer's embedding call at TP > 1: VocabParallelEmbedding's input_mask [b, s] "
        "bool kept, and at the forward peak its masked input [b, s] int64",
        "MTP, TP > 1; the output part's forward peak (its span holds the MTP layer)",
        lambda d: d.case.mtp and d.case.tp > 1 and d.part in ("mtp", "output"),
        kept=lambda d: d.s if d.part == "mtp" else 0,
        forward_peak=lambda d: d.s * 9 if d.part == "mtp" else d.s,
        backward_peak=lambda d: 0,
        storages=lambda d: ((d.s, "bool"),) if d.part == "mtp" else (),
        reason="the embedding rows above (tensor_parallel/layers.py VocabParallelEmbedding."
               "forward at TP > 1), for the embedding call MultiTokenPredictionLayer."
               "_get_embeddings makes on the rolled input ids: its masked input pairs with "
               "the rolled ids tracemem's embedding saves, its mask does not; the mask is still "
               "alive at the output part's forward peak"),
    ResidueRule(
        "megatron-core 0.16.1's inline MTP loss: mtp_logits [s, b, V / TP] bf16, the rolled "
        "mtp_labels [b, s] int64 and the masked loss [b, s] fp32 held to the end",
        "output, MTP, forward", lambda d: d.part == "output" and d.case.mtp,
        kept=lambda d: 0, forward_peak=lambda d: d.s * d.vocab * 2 + d.s * 8 + d.s * 4,
        backward_peak=lambda d: 0, storages=lambda d: (),
        reason="megatron-core 0.16.1 models/gpt/gpt_model.py GPTModel._postprocess runs the MTP "
               "depth's output layer and loss in its own body: its locals mtp_logits, "
               "mtp_labels and mtp_loss (loss_mask * mtp_loss) live until it returns, through "
               "the main output layer and loss; Megatron-LM d98e8a6, which tracemem follows, "
               "moved the loop into transformer/multi_token_prediction.py process_mtp_loss, "
               "which frees them on return (a version difference, found by a traceback at the "
               "free)"),
    ResidueRule(
        "the MTP loss kept for backward: the scaled per-token loss [b, s] fp32, the rolled loss "
        "mask [b, s] int64, num_tokens int64 and the loss tracker [1] fp32 (tracemem: the "
        "weighted mean, a scalar)", "output, MTP", lambda d: d.part == "output" and d.case.mtp,
        kept=lambda d: d.s * 4 + d.s * 8 + 8 + 4 - 4,
        forward_peak=lambda d: d.s * 4 + d.s * 8 + 8 + 4 - 4, backward_peak=lambda d: 0,
        storages=lambda d: ((d.s * 4, "float32"), (d.s * 8, "int64"), (8, "int64")),
        reason="GPTModel._postprocess (0.16.1; process_mtp_loss at d98e8a6): "
               "MTPLossAutoScaler.apply(hidden_states, mtp_loss_scale * mtp_loss / num_tokens) "
               "saves the scaled per-token loss, the division saves num_tokens (roll_tensor's "
               "sum), loss_mask * mtp_loss saves the rolled mask; MTPLossLoggingHelper."
               "save_loss_to_tracker keeps torch.zeros(mtp_num_layers) for logging (paired by "
               "size with tracemem's saved scalar); tracemem's MTP loss kernel returns the mean "
               "(modeling.kernels.loss.megatron_cross_entropy), weighted and saved by its "
               "autoscaler"),
    ResidueRule(
        "GlobalMemoryBuffer 'mpu' [b * s * h] bf16 (the output layer's SP all-gather)",
        "output, SP", lambda d: d.part == "output" and d.case.sp,
        kept=lambda d: 2 * d.s * d.h, forward_peak=lambda d: 2 * d.s * d.h,
        backward_peak=lambda d: 0, storages=lambda d: ((2 * d.s * d.h, "bfloat16"),),
        reason="tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication."
               "forward all-gathers the sequence-parallel input into get_global_memory_"
               "buffer().get_tensor(..., 'mpu') (utils.py GlobalMemoryBuffer): allocated "
               "once and kept for the run (persistent, as the RoPE cache); tracemem's "
               "head saves its local input and gathers into a temporary"),
)


def _dims(case: OracleCase, cfg, layer: int) -> _Dims:
    """Layer ``layer``; with ``case.whole`` -1 is the embedding and ``cfg.num_layers`` the
    output part (final norm, output layer, loss)."""
    s = case.seq_length
    n = cfg.num_attention_heads // case.tp
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    part = ("embedding" if layer < 0 else "mtp" if layer > cfg.num_layers
            else "output" if layer == cfg.num_layers else "layer")
    return _Dims(case, layer, part in ("layer", "mtp") and cfg.is_moe_layer(layer), s,
                 s // case.tp if case.sp else s, cfg.num_routed_experts, cfg.qk_rope_head_dim,
                 n, 2 * s * n * (2 * qk + cfg.v_head_dim), part, cfg.hidden_size,
                 cfg.vocab_size // case.tp)


def residue(case: OracleCase, layer: int, cfg=None) -> list[Residue]:
    """The rows of ``RESIDUE`` that apply to ``layer`` of ``case``, evaluated."""
    d = _dims(case, cfg or oracle_model_config(), layer)
    return [Residue(r.tensor, layer, r.kept(d), r.forward_peak(d), r.backward_peak(d),
                    r.storages(d), r.reason, r.tracemem_storages(d))
            for r in RESIDUE if r.applies(d)]


def unexplained(result: CaseResult) -> list[str]:
    """One line per difference of ``result`` that ``RESIDUE`` does not name: a layer's kept,
    forward peak or backward peak difference other than the residue's sum, unequal
    parameter bytes, a layer on one side only, a kept storage on one side without a residue
    row for it."""
    out = []
    name = result.case.name
    for layer in sorted(set(result.megatron) | set(result.tracemem)):
        if layer not in result.megatron or layer not in result.tracemem:
            out.append(f"{name}, layer {layer}: traced on one side only")
            continue
        m, t = result.megatron[layer], result.tracemem[layer]
        rows = residue(result.case, layer, result.cfg)
        for i, attr in enumerate(("kept", "forward_peak", "backward_peak")):
            got = getattr(m, attr) - getattr(t, attr)
            want = sum(getattr(r, attr) for r in rows)
            if got != want:
                out.append(f"{name}, layer {layer}: {attr} differs by {got:+,} B; the "
                           f"residue explains {want:+,} B")
        if m.params != t.params:
            out.append(f"{name}, layer {layer}: params {m.params:,} / {t.params:,} B")
        diff = result.diff(layer)
        got = sorted((s[0], s[1]) for s in diff.only_megatron)
        want = sorted(st for r in rows for st in r.storages)
        if got != want:
            out.append(f"{name}, layer {layer}: kept storages only on Megatron-Core's side "
                       f"{got}; the residue names {want}")
        got = sorted((s[0], s[1]) for s in diff.only_tracemem)
        want = sorted(st for r in rows for st in r.tracemem_storages)
        if got != want:
            out.append(f"{name}, layer {layer}: kept storages only on tracemem's side "
                       f"{[(s[0], s[1], list(s[2]), s[4], s[3]) for s in diff.only_tracemem]}"
                       f"; the residue names {want}")
    return out


def oracle_model_config(num_layers: int = 3):
    """deepseek-tiny (h 64, 4 heads, MLA with q LoRA, 8 routed experts top-2 in 4 groups, one
    shared expert, sigmoid router with correction bias) with ``num_layers`` layers, the first
    dense, no MTP, bf16."""
    from modeling import load_config
    cfg = load_config("deepseek-tiny")
    return dataclasses.replace(cfg, num_layers=num_layers, first_k_dense_replace=1,
                               num_mtp_modules=0, dtype="bfloat16")


def _megatron_config(cfg, case: OracleCase, **extra):
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
        moe_shared_expert_overlap=case.shared_expert_overlap, moe_permute_fusion=True,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        bf16=True, params_dtype=torch.bfloat16, perform_initialization=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=True, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, **({"gradient_accumulation_fusion": False} | extra),
        **recompute)


def _layer_bytes(tracer, layer_of: Callable[[str], int | None], params: dict[int, int],
                 end_forward: int) -> dict[int, LayerBytes]:
    events = tracer.events
    root = getattr(layer_of, "root", None)
    if root is not None:  # the whole model: the root module's storages are the embedding's
        # up to the first decoder layer's first allocation, the loss's after it
        born = {e.storage_id: e.index for e in events if e.action == "alloc"}
        start = next((e.index for e in events if e.action == "alloc"
                      and e.phase is Phase.FORWARD and e.module
                      and layer_of(e.module) is not None
                      and 0 <= layer_of(e.module) < root[1]), 0)
        plain = layer_of
        late = getattr(plain, "late", None)

        def layer_of(module, storage_id=None, _plain=plain):
            if module != "":
                part = _plain(module)
                if late is not None and part == root[0] \
                        and start <= born.get(storage_id, 0) <= end_forward:
                    return late  # the embedding called again in the forward: the MTP's
                return part
            return root[0] if born.get(storage_id, start) < start else root[1]
    else:
        plain = layer_of

        def layer_of(module, storage_id=None, _plain=plain):
            return _plain(module)
    spans: dict[tuple[int, str], list[int]] = {}
    for e in events:  # a layer's pass spans its first to its last allocation (a free names
        # the module that made the storage, which may have run long before)
        if e.action != "alloc":
            continue
        layer = layer_of(e.module, e.storage_id) \
            if e.index > end_forward or e.phase is Phase.FORWARD else None
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
                             if i.phase is Phase.FORWARD
                             and layer_of(i.module, i.storage_id) == layer),
                            key=lambda s: (-s[0], s[3])))
        out[layer] = LayerBytes(sum(s[0] for s in kept), peak(spans[(layer, "f")]),
                                peak(spans[(layer, "b")]) if (layer, "b") in spans else 0,
                                params.get(layer, 0), kept,
                                peak_set(spans[(layer, "f")]),
                                peak_set(spans[(layer, "b")]) if (layer, "b") in spans else ())
    return out


def _trace(model, run, x_shape, layer_of, param_layer_of, state=(),
           tokens: int | None = None) -> dict[int, LayerBytes]:
    """Trace ``run`` forward and backward: on a received ``x_shape`` bf16 input and a
    received output gradient (a middle stage); or, with ``tokens``, on ``(1, tokens)``
    int64 input ids and labels made before the trace (the data loader's), backward from the
    loss's sum."""
    from modeling.parallel.pp import recv_backward, recv_forward
    from tracemem.tracer import MemoryTracer

    params: dict[int, int] = {}
    for name, p in model.named_parameters():
        layer = param_layer_of(name)
        if layer is not None:
            params[layer] = params.get(layer, 0) + p.numel() * p.element_size()
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    inputs = ()
    if tokens is not None:
        inputs = tuple(torch.zeros((1, tokens), dtype=torch.long, device="meta")
                       for _ in range(2))
    tracer.track_external(model, list(state), list(inputs))
    with tracer, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # c10d's deprecated collective names
        if tokens is not None:
            out = run(*inputs)
            end_forward = len(tracer.events) - 1
            out.sum().backward()
            del out
        else:
            x = recv_forward(x_shape, torch.bfloat16)
            out = run(x)
            end_forward = len(tracer.events) - 1
            grad = recv_backward(tuple(out.shape), torch.bfloat16)
            out.backward(grad)
            del out, grad, x
    return _layer_bytes(tracer, layer_of, params, end_forward)


def _part_index(layers: str, embedding: tuple[str, ...], output: tuple[str, ...],
                num_layers: int, mtp: tuple[str, ...] = ()):
    """The whole model's parts as ``_layer_bytes`` keys: -1 the embedding, each decoder layer
    its number, ``num_layers`` the final norm, output layer and loss (``output`` module
    prefixes and the root module, where both sides compute the loss), ``num_layers + 1`` the
    MTP (``mtp`` prefixes; with the embedding's storages made in the forward after the decoder
    began: the MTP layer's embedding call, ``_layer_bytes``)."""
    layer_of = _layer_index(layers)

    def under(module: str, prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    def of(module: str) -> int | None:
        if module == "" or under(module, output):
            return num_layers
        if under(module, embedding):
            return -1
        if mtp and under(module, mtp):
            return num_layers + 1
        return layer_of(module)
    of.root = (-1, num_layers)  # the root module's ops: split in time (_layer_bytes)
    of.late = num_layers + 1 if mtp else None  # the embedding's later forward storages
    return of


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

    from modeling.kernels import get_profile

    par = ParallelConfig.create(cfg, world_size=case.world_size, tp=case.tp, sp=case.sp,
                                ep=case.ep, etp=case.etp)
    # the case's loss: "none", Megatron-Core's default (no --cross-entropy-loss-fusion, its
    # own tensor_parallel.vocab_parallel_cross_entropy), or "native" (fused_cross_entropy.py)
    kernels = get_profile("megatron-te", cross_entropy_fusion=case.cross_entropy,
                          moe_shared_expert_overlap=case.shared_expert_overlap)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels=kernels)
    for block in model.layers.values():
        block.set_recompute(case.recompute, frozenset(case.modules))
    if case.whole:
        part = _part_index("layers.", ("embed",), ("norm", "head"), cfg.num_layers,
                           ("mtp",) if case.mtp else ())
        return _trace(model, lambda tokens, labels: model(tokens, labels, routing), None,
                      part, part, tokens=case.seq_length)
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
        config = _megatron_config(cfg, case, **({"gradient_accumulation_fusion": True}
                                                 if case.whole else {}),
                                  **({"mtp_num_layers": 1} if case.mtp else {}),
                                  **({"cross_entropy_loss_fusion": True,
                                      "cross_entropy_fusion_impl": case.cross_entropy}
                                     if case.cross_entropy != "none" else {}))
        patches.set_routing(routing)
        specs = decoder_layer_specs(config)
        mtp_spec = None
        if case.mtp:  # gpt_layer_specs.py, with the oracle's leaves
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_mtp_block_spec_for_backend)
            from tracemem.oracle.megatron_spec import TracememSpecProvider
            mtp_spec = get_gpt_mtp_block_spec_for_backend(config, specs,
                                                          backend=TracememSpecProvider())
        with torch.device("meta"):
            model = GPTModel(config, specs, vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.max_position_embeddings,
                             pre_process=case.whole, post_process=case.whole,
                             position_embedding_type="none", mtp_block_spec=mtp_spec)
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
            if case.whole:  # GPTModel.forward returns the per-token loss [b, s] fp32
                # --gradient-accumulation-fusion for Megatron-Core's own output layer (a
                # ColumnParallelLinear, not a TE leaf): its weight gradient goes into
                # main_grad, as the megatron-te head's does (no grad_added_to_main_grad
                # attribute without DDP: no dummy wgrad either, a workspace in tracemem)
                weight = model.output_layer.weight
                weight.main_grad = torch.empty(weight.shape, dtype=torch.float32,
                                               device="meta")
                state = [*state, weight.main_grad]
                # the batch's position_ids [b, s] int64 (the data loader's), which
                # MultiTokenPredictionLayer rolls; unused without MTP (no position embedding)
                positions = torch.zeros(1, case.seq_length, dtype=torch.long, device="meta") \
                    if case.mtp else None
                if positions is not None:
                    state = [*state, positions]
                part = _part_index("decoder.layers.", ("embedding",),
                                   ("decoder.final_layernorm", "output_layer"),
                                   cfg.num_layers, ("mtp",) if case.mtp else ())
                return _trace(model, lambda tokens, labels: model(tokens, positions, None,
                                                                  labels=labels),
                              None, part, part, state, tokens=case.seq_length)
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
    if case.mtp:
        if not case.whole:
            raise TracememError("an MTP oracle case runs the whole model (whole=True)")
        cfg = dataclasses.replace(cfg, num_mtp_modules=1)
    routing = routing or Balanced()
    result = CaseResult(case, cfg)
    result.megatron = _run_megatron(cfg, case, routing)
    result.tracemem = _run_tracemem(cfg, case, routing)
    return result


def _part_name(result: CaseResult, layer: int) -> str:
    """A layer's number, or for the whole model "embedding" (-1) and "output" (the final
    norm, output layer and loss)."""
    if layer < 0:
        return "embedding"
    if result.case.whole and layer >= (result.cfg or oracle_model_config()).num_layers:
        return "MTP" if layer > (result.cfg or oracle_model_config()).num_layers else "output"
    return str(layer)


def byte_cells(a: LayerBytes, b: LayerBytes) -> list[str]:
    """The kept, forward peak, backward peak and parameter bytes of one part: ``"n"`` where
    the two sides agree, ``"a / b"`` where they differ (the oracle's side first)."""
    cells = []
    for attr in ("kept", "forward_peak", "backward_peak", "params"):
        x, y = getattr(a, attr), getattr(b, attr)
        cells.append(f"{x:,}" if x == y else f"{x:,} / {y:,}")
    return cells


def oracle_report(rows: list[list[str]], part: str, legend: str, notes: list[str],
                  residue_title: str, residue, bad: list[str], residue_name: str,
                  lead: str | None = None) -> str:
    """An oracle's text (``tracemem validate --against``): the table of ``rows`` (layout,
    ``part``, ``byte_cells``), the legend, ``notes`` (kept storages that differ), the residue
    rows numbered, and the verdict: FAIL with every line of ``bad`` (and ``lead``, a known
    cause that is not a residue row), or OK naming ``residue_name``."""
    from tabulate import tabulate

    table = tabulate(rows, headers=["layout", part, "kept B", "forward peak B",
                                    "backward peak B", "params B"],
                     disable_numparse=True, colalign=("left", "right", "right", "right",
                                                      "right", "right"))
    rules = [f"{i}. {r.tensor} ({r.where}): {r.reason}" for i, r in enumerate(residue, 1)]
    verdict = ([f"FAIL: {len(bad)} difference(s) the residue does not name:",
                *(f"- {line}" for line in bad), *([lead] if lead else [])] if bad else
               [f"OK: every difference is in the residue ({residue_name})."])
    return "\n".join([table, "", legend] + (["", "Kept storages that differ:", *notes]
                                             if notes else [])
                      + ["", residue_title, *rules, "", *verdict])


def format_results(results: list[CaseResult]) -> str:
    """One row per (case, layer): Megatron-Core's and tracemem's bytes and their difference,
    then every kept storage that differs, by layer."""
    rows, notes = [], []
    for r in results:
        for i in sorted(r.megatron):
            rows.append([r.case.name, _part_name(r, i),
                         *byte_cells(r.megatron[i], r.tracemem.get(i, LayerBytes(0, 0, 0, 0)))])
            d = r.diff(i)
            for side, items in (("Megatron-Core only", d.only_megatron),
                                ("tracemem only", d.only_tracemem)):
                for nbytes, dtype, shape, module, op in items:
                    notes.append(f"- {r.case.name}, {_part_name(r, i)}, {side}: {nbytes:,} B "
                                 f"{dtype} {list(shape)} made by {op} in {module}")
    legend = ("Cells: equal bytes, or 'Megatron-Core / tracemem'. Rank 0 of each layout, b=1, "
              "s=16, deepseek-tiny with 3 layers (layer 0 dense), megatron-te kernels "
              "(cross_entropy_fusion none: Megatron-Core's default loss, unless the layout "
              "names the native fused cross entropy). 'whole model': also the embedding and "
              "the output part (final norm, output layer, loss).")
    return oracle_report(rows, "layer", legend, notes,
                         "The residue (Megatron-Core minus tracemem, by hand):", RESIDUE,
                         [line for r in results for line in r.unexplained],
                         "tracemem.oracle.compare.RESIDUE")


def results_json(results: list[CaseResult]) -> list[dict]:
    """Per layout: both sides' bytes per layer, the residue rows that apply (evaluated) and
    the differences the residue does not name (``unexplained``; empty: the layout passes);
    ``equal``: both sides agree to the byte without the residue."""
    out = []
    for r in results:
        layers = {}
        for i in sorted(r.megatron):
            layers[str(i)] = {side: {k: getattr(b[i], k) for k in
                                     ("kept", "forward_peak", "backward_peak", "params")}
                              for side, b in (("megatron_core", r.megatron),
                                              ("tracemem", r.tracemem)) if i in b}
            layers[str(i)]["residue"] = [
                {"tensor": x.tensor, "kept": x.kept, "forward_peak": x.forward_peak,
                 "backward_peak": x.backward_peak} for x in residue(r.case, i, r.cfg)]
        out.append({"layout": r.case.name, "equal": r.equal, "unexplained": r.unexplained,
                    "layers": layers})
    return out


def run_command(json_out: bool = False, cases=None, static_cases=None,
                schedule_cases=None) -> tuple[str, int]:
    """``tracemem validate --against megatron-core``: every case of ``cases`` (default
    ``ORACLE_CASES``, read when called) run, the static cases ``static_cases`` (default
    ``tracemem.oracle.static_oracle.STATIC_CASES``) and the schedule cases
    ``schedule_cases`` (default ``tracemem.oracle.schedule_oracle.SCHEDULE_CASES``); returns
    the text (the tables, or JSON with ``json_out``) and the exit code: 0 when every
    difference is in the residue tables (``RESIDUE``, ``static_oracle.STATIC_RESIDUE``,
    ``schedule_oracle.SCHEDULE_RESIDUE``), 1 otherwise.

    Raises:
        TracememError: megatron-core missing or not the pinned version.
    """
    import json

    from tracemem.oracle import schedule_oracle, static_oracle

    results = [run_case(case) for case in (ORACLE_CASES if cases is None else cases)]
    static = static_oracle.run_static_cases(static_cases)
    schedules = schedule_oracle.run_schedule_cases(schedule_cases)
    bad = [line for r in (*results, *static, *schedules) for line in r.unexplained]
    if json_out:
        text = json.dumps({"layers": results_json(results),
                           "static": static_oracle.results_json(static),
                           "schedules": schedule_oracle.results_json(schedules),
                           "unexplained": bad}, indent=2)
    else:
        text = "\n\n".join([format_results(results), static_oracle.format_results(static),
                             schedule_oracle.format_results(schedules)])
    return text, 1 if bad else 0
