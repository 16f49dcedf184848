"""The language model for one training step (DeepSeek-V2 / V3, the dense and MoE Hugging Face
families, Megatron's GPT): embedding (with learned absolute positions for GPT), decoder layers
(held in a ``ModuleDict`` keyed by the global layer number), final norm, output head,
cross-entropy loss, and V3's multi-token-prediction (MTP) modules sharing the embedding and the
head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.common import cpu_offload
from modeling.common.block import Block
from modeling.common.config import ModelConfig
from modeling.common.custom import (
    CustomBlock,
    LayerContext,
    Replacements,
    build_replacement,
    resolve_replacements,
)
from modeling.kernels import KernelProfile, get_profile
from modeling.kernels.loss import chunked_cross_entropy
from modeling.common.linear import Linear
from modeling.common.norm import make_norm
from modeling.parallel.collectives import all_gather, reduce_scatter, scatter_to_sequence_parallel
from modeling.parallel.groups import (
    column,
    declare_fsdp_unit,
    declare_module,
    replicated,
    set_component,
)
from modeling.parallel.plans import LocalSizes
from modeling.common.routing import RoutingModel
from tracemem.errors import TracememError

__all__ = ["Transformer", "MTPModule", "MTPBlock", "MTP_LOSS_WEIGHT", "build_model",
           "cast_parameters", "resolve_experts"]

# DeepSeek-V3 technical report (arXiv 2412.19437), section 4.2: the MTP loss weight is 0.3 for
# the first 10T training tokens and 0.1 afterwards.
MTP_LOSS_WEIGHT = 0.3


class MTPModule(nn.Module):
    """Multi-token prediction depth ``depth`` (1-based): ``eh_proj([enorm(emb(t_{i+k}));
    hnorm(h_{i})])`` through one decoder layer and a final norm (``norm``, Hugging Face's
    ``shared_head.norm``); the embedding and output head are the main model's."""

    def __init__(self, layer_id: int, cfg: ModelConfig, attention: str, experts: str,
                 sizes: LocalSizes, kernels: KernelProfile | None = None,
                 replace: Replacements | None = None, rank=None):
        super().__init__()
        self.sizes = sizes
        self.kernels = kernels = kernels or get_profile("eager")
        h = cfg.hidden_size
        # counted apart from the main model: the projection and its norms, and the layer
        norm = replicated("mtp_projection")
        self.enorm = make_norm(cfg, h, kernels, group=norm)
        self.hnorm = make_norm(cfg, h, kernels, group=norm)
        self.eh_proj = Linear(2 * h, sizes.eh_proj_out, bias=False, kernels=kernels,
                              group=column("mtp_projection"))
        self.block = _layer(layer_id, cfg, attention, experts, sizes, kernels, replace, rank)
        set_component(self.block, "mtp_layer")
        self.norm = make_norm(cfg, h, kernels, group=norm)

    def forward(self, hidden: Tensor, embedded: Tensor, routing: RoutingModel,
                embed=None, shift: int = 0) -> Tensor:
        """``hidden``, ``embedded``: this rank's tokens ``(b, s_local, h)``. With ``embed``
        (the model's embedding, a function of token ids), ``embedded`` are token ids ``(b,
        s)``, rolled by ``shift`` and embedded here, as Megatron-Core's
        ``MultiTokenPredictionLayer._get_embeddings`` rolls its input ids and calls the
        embedding inside the layer (the megatron orchestration)."""
        if embed is not None:
            embedded = embed(embedded.roll(shift, dims=1))
        sp, tp = self.sizes.sp, self.sizes.tp
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # (b, s_local, 2h)
        # column-parallel eh_proj (Megatron-Core multi_token_prediction.py): gather the
        # sequence, project to h / tp, gather the hidden dimension, split the sequence again
        if self.kernels.orchestration == "megatron":  # TE column-parallel: saves local input
            x = all_gather(self.eh_proj(x, "column", sp), tp, dim=-1)
        else:
            x = all_gather(self.eh_proj(all_gather(x, sp, dim=1)), tp, dim=-1)
        # the sequence split: Megatron-Core's scatter_to_sequence_parallel_region, a view of
        # the gathered projection (which it keeps alive); the torch orchestration's copy
        split = scatter_to_sequence_parallel if self.kernels.orchestration == "megatron" \
            else reduce_scatter
        return self.norm(self.block(split(x, sp, dim=1), routing))


class MTPBlock(nn.ModuleDict):
    """The MTP modules by depth (``"0"``, ``"1"``, ...); called on the decoder's and each
    depth's hidden states it concatenates them, as Megatron-Core's
    ``MultiTokenPredictionBlock.forward`` does (``torch.cat(hidden_states_list)``: Megatron-LM
    d98e8a6 and megatron-core 0.16.1, transformer/multi_token_prediction.py): here along b,
    Megatron's ``[s, b, h]`` along s, the same contiguous chunks (``Transformer.
    _megatron_mtp_loss``)."""

    def forward(self, hiddens: list[Tensor]) -> Tensor:
        return torch.cat(hiddens, dim=0)


class Transformer(nn.Module):
    """The model, or the part of it one pipeline rank holds. ``forward`` returns the training
    loss on the last stage and the hidden states ``(b, s, h)`` elsewhere.

    Args:
        cfg: sizes.
        attention: ``"flash"`` or ``"eager"`` (``modeling.common.attention.mla.MLA``).
        kernels: a ``modeling.kernels`` profile (default eager).
        experts: ``"grouped"`` or ``"sequential"`` (``modeling.common.moe.MoE``).
        sizes: local module sizes (``modeling.parallel.plans.LocalSizes``); default unsharded.
        chunks: the global layer numbers of each model chunk held (one chunk without virtual
            pipeline stages); default one chunk of all layers.
        pre_process: holds the embedding (the first stage).
        post_process: holds the final norm, head, loss and MTP modules (the last stage); with
            MTP it also holds an embedding, as Megatron-Core's MTP stage does.
        replace: the user's own layers (``modeling.common.custom``: "attn", "mlp" or "block"
            factories, resolved); ``rank``: this rank's coordinates, passed to them.

    Each parameter declares its group where it is made (``modeling.parallel.groups``); the
    embedding (vocabulary split over TP, dim 0), the position embedding, each decoder layer,
    each MTP module and the head are declared ZeRO-3 / FSDP units here.

    With ``cfg.position_embedding`` "learned_absolute" the embedding is Megatron-Core's
    ``LanguageModelEmbedding`` (megatron/core/models/common/embeddings/
    language_model_embedding.py at Megatron-LM d98e8a6): ``position_embed``, a plain
    ``torch.nn.Embedding(max_position_embeddings, h)`` replicated over TP (no
    ``tensor_model_parallel``; counted under "embedding"), held wherever the word embedding is
    (the first stage, and the MTP stage); a tied head shares the word embedding only
    (``LanguageModule.shared_embedding_or_output_weight``).

    Tokens and labels are ``(b, s)`` int64. MTP depth k predicts the token k positions further:
    its inputs are the tokens and labels rolled left by k (same length s, as Megatron-LM does),
    and with learned positions the position ids rolled left by k too (Megatron-Core's
    ``MultiTokenPredictionLayer._get_embeddings`` rolls ``input_ids`` and ``position_ids`` and
    calls the model's embedding; Megatron-LM's ``validate_args`` refuses MTP with learned
    positions, and so does the gpt family's loader).
    """

    def __init__(self, cfg: ModelConfig, attention: str = "flash", experts: str = "grouped",
                 sizes: LocalSizes | None = None, chunks: list[list[int]] | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 kernels: KernelProfile | None = None, replace: Replacements | None = None,
                 rank=None):
        super().__init__()
        sizes = sizes or LocalSizes.full(cfg)
        self.kernels = kernels = kernels or get_profile("eager")
        self.cfg, self.sizes = cfg, sizes
        self.chunks = chunks if chunks is not None else [list(range(cfg.num_layers))]
        self.pre_process, self.post_process = pre_process, post_process
        has_mtp = post_process and cfg.num_mtp_modules > 0
        self.embed = (declare_fsdp_unit(declare_module(
            nn.Embedding(sizes.vocab, cfg.hidden_size), column("embedding")))
            if pre_process or has_mtp else None)  # VocabParallelEmbedding: vocab split
        # one embedding (and one head below) per rank: a rank holding chunk 0 and the MTP
        # (DualPipe, V) shares them with MTP (arXiv 2412.19437 2.2, 3.2.3); the MTP stage of
        # Megatron's 1F1B / interleaved holds its own copy (GPTModel: pre_process or mtp_process)
        # LanguageModelEmbedding.position_embeddings ("serial": the whole table on every rank)
        learned = cfg.position_embedding == "learned_absolute"
        self.position_embed = (declare_fsdp_unit(declare_module(
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size),
            replicated("embedding"))) if learned and self.embed is not None else None)
        self.layers = nn.ModuleDict({
            str(i): declare_fsdp_unit(_layer(i, cfg, attention, experts, sizes, kernels,
                                             replace, rank))
            for chunk in self.chunks for i in chunk})
        if post_process:
            self.norm = make_norm(cfg, cfg.hidden_size, kernels)
            # a ZeRO-3 unit kept gathered from its forward to its backward (tracemem.zero3)
            # the output layer is Megatron's tensor_parallel.ColumnParallelLinear, not a TE
            # module: bf16 under FP8 (its --fp8-output-proj is refused)
            head_kernels = kernels.without_fp8() if hasattr(kernels, "without_fp8") else kernels
            self.head = declare_fsdp_unit(Linear(cfg.hidden_size, sizes.vocab, bias=False,
                                                 kernels=head_kernels,
                                                 group=column("output_head")),
                                          reshard_after_forward=False)
            if cfg.tie_word_embeddings and self.embed is not None:
                self.head.weight = self.embed.weight
            self.mtp = MTPBlock({
                str(i): declare_fsdp_unit(MTPModule(cfg.num_layers + i, cfg, attention,
                                                    experts, sizes, kernels, replace, rank))
                for i in range(cfg.num_mtp_modules)})

    def _embed(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """The embedding of ``tokens`` ``(b, s / cp)`` (and, with learned positions, of
        ``positions``, the same shape), this rank's ``(b, s / (cp * sp), h)``."""
        if self.position_embed is None:
            # vocabulary-parallel embedding: with SP its sum over TP is reduce-scattered along
            # the sequence (Megatron-Core LanguageModelEmbedding), else all-reduced in place
            return self._embedding_dropout(
                reduce_scatter(self.embed(tokens), self.sizes.sp, dim=1))  # (b, s_local, h)
        # LanguageModelEmbedding.forward with learned absolute positions: no reduce-scatter
        # in the word embedding (reduce_scatter_embeddings is False), an all-reduce over TP in
        # place (reduce_from_tensor_model_parallel_region: nothing allocated)
        word_embeddings = self.embed(tokens)  # (b, s, h)
        position_embeddings = self.position_embed(positions)  # (b, s, h)
        embeddings = word_embeddings + position_embeddings  # both stay alive until return
        if self.kernels.orchestration == "megatron" and embeddings.shape[0] > 1:
            # [b s h] -> [s b h]: transpose(0, 1).contiguous(), a copy unless b is 1 (then
            # the transposed view is already contiguous); tracemem keeps (b, s, h): a clone
            embeddings = embeddings.clone()
        # SP: scatter_to_sequence_parallel_region (a view of this rank's slice) and its clone
        # (clone_scatter_output_in_embedding, default True): one (b, s / sp, h) copy, whose
        # backward all-gathers, as a reduce-scatter's does
        embeddings = reduce_scatter(embeddings, self.sizes.sp, dim=1)  # (b, s / (cp * sp), h)
        return self._embedding_dropout(embeddings)

    def _embedding_dropout(self, embeddings: Tensor) -> Tensor:
        """``LanguageModelEmbedding.embedding_dropout`` (megatron/core/models/common/embeddings/
        language_model_embedding.py: ``torch.nn.Dropout(config.hidden_dropout)``, applied last,
        after the sequence-parallel scatter, under the TP RNG tracker's fork with SP) on this
        rank's ``(b, s_local, h)``: the profile's dropout (``modeling.kernels.dropout``);
        ``embeddings`` itself when ``cfg.hidden_dropout`` is 0 or outside training."""
        return self.kernels.dropout(embeddings, self.cfg.hidden_dropout, self.training)

    def _positions(self, tokens: Tensor) -> Tensor | None:
        """Position ids ``(b, s / cp)`` int64 for learned positions, else None. Megatron's
        batch carries them (``position_ids`` ``[b, s]`` int64, megatron/core/utils.py
        ``get_batch_on_this_tp_rank``); here the forward makes them: an arange of s / cp,
        freed, and its ``(b, s / cp)`` repeat, which the embedding's backward keeps.

        Raises:
            TracememError: the sequence is longer than the position table (Megatron's
                ``validate_args``: ``max_position_embeddings >= seq_length``).
        """
        if self.position_embed is None:
            return None
        b, s = tokens.shape
        if s * self.sizes.cp > self.cfg.max_position_embeddings:
            raise TracememError(
                f"--seq-length {s * self.sizes.cp} is longer than max_position_embeddings "
                f"({self.cfg.max_position_embeddings}) of {self.cfg.name}: learned absolute "
                f"position embeddings have one row per position; use --seq-length <= "
                f"{self.cfg.max_position_embeddings}")
        return torch.arange(s, device=tokens.device).repeat(b, 1)  # (b, s / cp)

    def _loss(self, hidden: Tensor, labels: Tensor) -> Tensor:
        if self.kernels.orchestration == "megatron":  # output_layer gathers inside
            logits = self.head(hidden, "column", self.sizes.sp)  # (b, s / cp, vocab held)
        else:
            hidden = all_gather(hidden, self.sizes.sp, dim=1)  # column-parallel head
            chunks = getattr(self.kernels, "loss_chunks", 0)
            if chunks:  # torchtitan's ChunkedLossWrapper: head + loss per sequence chunk
                return chunked_cross_entropy(
                    hidden, labels, self.head,
                    lambda logits, labels: self.kernels.loss(logits, labels, self.sizes.tp),
                    chunks)
            logits = self.head(hidden)  # (b, s / cp, vocab held)
        return self.kernels.loss(logits, labels, self.sizes.tp)

    def _megatron_mtp_loss(self, h: Tensor, labels: Tensor, routing: RoutingModel) -> Tensor:
        """The last chunk's end with MTP under the megatron orchestration, in Megatron-Core's
        order (``GPTModel._postprocess``, Megatron-LM d98e8a6 and megatron-core 0.16.1): the
        final norm closes the decoder (``TransformerBlock.has_final_layernorm_in_this_stage``
        with ``mtp_num_layers``: the stage of the last decoder layer), the MTP layers run on
        its output (``MultiTokenPredictionBlock.forward``) and their outputs and it are
        concatenated (``torch.cat(hidden_states_list)``: one new tensor, which each output
        layer's saved input is a view of; here along b, Megatron's ``[s, b, h]`` along s: the
        same contiguous chunks), then ``process_mtp_loss`` runs each depth's output layer and
        loss, attaching it to the main hidden states (``MTPLossAutoScaler``), and the main
        output layer and loss run last. Not traced: the loss-mask products of
        ``process_mtp_loss`` (a few ``(b, s)`` fp32 and int64 tensors a depth), as the main
        loss's masking in the training loop is not."""
        h = self.norm(h)
        outs = [h]
        positions = self._positions(labels)
        for depth, module in enumerate(self.mtp.values(), start=1):
            rolled = None if positions is None else positions.roll(-depth, dims=1)
            # the MTP embeds the following tokens: the labels, rolled further (inside the
            # layer, as MultiTokenPredictionLayer._get_embeddings)
            outs.append(module(outs[-1], labels, routing,
                               embed=lambda tokens, rolled=rolled: self._embed(tokens, rolled),
                               shift=-(depth - 1)))
        parts = self.mtp(outs).chunk(len(outs), dim=0)  # MultiTokenPredictionBlock's cat
        del outs  # MultiTokenPredictionBlock.hidden_states_list dies with it: the MTP outputs go
        main = parts[0]
        for depth in range(1, len(parts)):
            mtp_loss = MTP_LOSS_WEIGHT * self._loss(parts[depth], labels.roll(-depth, dims=1))
            main = _MTPLossAutoScaler.apply(main, mtp_loss)
        return self._loss(main, labels)

    def forward(self, inputs: Tensor, labels: Tensor, routing: RoutingModel,
                chunk: int = 0) -> Tensor:
        """``inputs``: tokens ``(b, s / cp)`` on the first chunk of the first stage, else the
        hidden states ``(b, s / (cp * sp), h)`` received from the previous stage; ``labels``
        ``(b, s / cp)``."""
        first = chunk == 0 and self.pre_process
        last = chunk == len(self.chunks) - 1 and self.post_process
        h = self._embed(inputs, self._positions(inputs)) if first else inputs
        for i in self.chunks[chunk]:
            # TE's CPU offloading (modeling.common.cpu_offload): TransformerBlock.forward's
            # ``with self.offload_context`` and synchronization function (identities when off)
            with cpu_offload.layer():
                h = self.layers[str(i)](h, routing)
            h = cpu_offload.synchronize(h)
        if not last:
            return h
        if len(self.mtp) and self.kernels.orchestration == "megatron":
            return self._megatron_mtp_loss(h, labels, routing)
        loss = self._loss(self.norm(h), labels)
        tokens = labels  # the MTP embeds the following tokens: the labels, rolled further
        positions = self._positions(labels) if len(self.mtp) else None
        for depth, module in enumerate(self.mtp.values(), start=1):
            rolled = None if positions is None else positions.roll(-depth, dims=1)
            h = module(h, self._embed(tokens.roll(-(depth - 1), dims=1), rolled), routing)
            loss = loss + MTP_LOSS_WEIGHT * self._loss(h, labels.roll(-depth, dims=1))
        return loss


class _MTPLossAutoScaler(torch.autograd.Function):
    """Megatron-Core's ``MTPLossAutoScaler`` (megatron/core/transformer/
    multi_token_prediction.py, Megatron-LM d98e8a6 and megatron-core 0.16.1): the identity on
    ``output`` that saves the MTP loss and, in backward, gives it its gradient
    (``torch.ones_like(mtp_loss) * main_loss_backward_scale``), so the main loss's backward
    runs the MTP branch."""

    @staticmethod
    def forward(ctx, output: Tensor, mtp_loss: Tensor) -> Tensor:
        ctx.save_for_backward(mtp_loss)
        return output

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mtp_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(mtp_loss)


def _layer(layer_id: int, cfg: ModelConfig, attention: str, experts: str, sizes: LocalSizes,
           kernels: KernelProfile, replace: Replacements | None, rank) -> nn.Module:
    """Decoder layer ``layer_id``: a ``Block``, or the user's (``replace["block"]``) held in
    a ``CustomBlock``."""
    if replace and "block" in replace:
        ctx = LayerContext(cfg, layer_id, sizes, kernels, attention,
                           cfg.is_moe_layer(layer_id), rank)
        return CustomBlock(build_replacement(replace["block"], "block", ctx), layer_id)
    # --first-last-layers-bf16: the layer's own profile, without FP8 (Megatron fp8_utils.py
    # get_fp8_context / is_first_last_bf16_layer)
    if hasattr(kernels, "bf16_layer"):
        kernels = kernels.bf16_layer(layer_id, cfg.num_layers)
    return Block(layer_id, cfg, attention, experts, sizes, kernels, replace, rank)


def build_model(cfg: ModelConfig, device: str | torch.device = "meta", *,
                attention: str = "flash", experts: str = "auto",
                dtype: torch.dtype | None = None,
                kernels: str | KernelProfile = "eager", replace=None) -> Transformer:
    """``Transformer(cfg)`` built directly on ``device``, its parameters in ``dtype`` (default
    the config's ``torch_dtype``); buffers (the router's correction bias, RoPE frequencies)
    stay float32, as in DeepSeek-V3's reference model. ``experts="auto"`` is "grouped" for
    bfloat16 parameters and "sequential" otherwise (see ``resolve_experts``). ``kernels``: a
    ``modeling.kernels`` profile or its name (default "eager", the kernels that run for real
    on a CPU). ``replace``: the user's own layers (``modeling.common.custom.resolve_replacements``:
    a dict of "attn" / "mlp" / "block" to a class, factory or "pkg.mod:Name", or a list of
    "kind=pkg.mod:Name" strings).

    Raises:
        TracememError: ``experts="grouped"`` with parameters that are not bfloat16; an
            unknown kernel profile; a bad ``replace``.
    """
    dtype = dtype or getattr(torch, cfg.dtype)
    profile = get_profile(kernels)
    replacements = resolve_replacements(replace)
    with torch.device(device):
        model = Transformer(cfg, attention, resolve_experts(
            experts, dtype, (cfg.hidden_size, cfg.moe_intermediate_size)), kernels=profile,
            replace=replacements)
    cast_parameters(model, dtype)
    return model


def resolve_experts(experts: str, dtype: torch.dtype, dims: tuple[int, ...] = ()) -> str:
    """The expert kernel for parameters of ``dtype`` and expert matrix sizes ``dims`` (the
    hidden size and the expert width held): ``torch._grouped_mm`` takes bfloat16 only, with
    every dimension a multiple of 8 (its operands' strides must be 16-byte aligned), so "auto"
    picks "grouped" when both hold and "sequential" otherwise.

    Raises:
        TracememError: "grouped" with another dtype or a size that is not a multiple of 8.
    """
    aligned = all(d % 8 == 0 for d in dims)
    if experts == "auto":
        return "grouped" if dtype == torch.bfloat16 and aligned else "sequential"
    if experts == "grouped" and dtype != torch.bfloat16:
        raise TracememError(f"--experts grouped needs bfloat16 parameters (torch._grouped_mm); "
                            f"the parameters are {str(dtype).removeprefix('torch.')}: use "
                            f"--experts sequential or auto")
    if experts == "grouped" and not aligned:
        raise TracememError(f"--experts grouped needs the hidden size and the expert width "
                            f"held to be multiples of 8 (torch._grouped_mm's 16-byte stride "
                            f"alignment); they are {', '.join(map(str, dims))}: use --experts "
                            f"sequential or auto")
    return experts


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters to ``dtype`` in place (a tied head stays tied); buffers keep theirs."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
