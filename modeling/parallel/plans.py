"""Sharding plans: what one rank holds of each module.

A plan is data: for each module it says how TP, EP and ETP cut it. ``local_sizes`` turns a plan,
a model and a parallel layout into the local sizes the modules are built with.

``megatron`` follows Megatron-Core:
- Grouped-query attention (megatron/core/transformer/attention.py ``SelfAttention.__init__``):
  ``linear_qkv`` (wq, wk, wv and their biases) column-parallel, n_h / TP query heads and
  num_query_groups / TP key/value heads per rank (``num_query_groups_per_partition``;
  ``tracemem.ParallelConfig`` refuses TP not dividing the query groups); ``linear_proj``
  (wo) row-parallel; ``q_layernorm`` / ``k_layernorm`` replicated.
- MLA (megatron/core/transformer/multi_latent_attention.py, ``MLASelfAttention.__init__``):
  ``linear_q_down_proj`` (wq_a) and ``linear_kv_down_proj`` (wkv_a, with the RoPE key) are
  ``parallel_mode='duplicated'``: replicated; ``linear_q_up_proj`` (wq_b), ``linear_q_proj``
  (wq) and ``linear_kv_up_proj`` (wkv_b) are column-parallel (``gather_output=False``);
  ``linear_proj`` (wo) is row-parallel (``input_is_parallel=True``); q/kv layernorms replicated.
- Dense MLP and shared experts (megatron/core/transformer/mlp.py, moe/shared_experts.py
  ``SharedExpertMLP``): fc1 (w1, w3) column-parallel, fc2 (w2) row-parallel over TP.
- Router (megatron/core/transformer/moe/router.py ``TopKRouter``): weight and expert bias
  replicated.
- Routed experts (megatron/core/transformer/moe/experts.py): num_local_experts = E / EP, each
  expert's fc1 column-parallel and fc2 row-parallel over ETP.
- Embedding and output layer (megatron/core/tensor_parallel/layers.py
  ``VocabParallelEmbedding``, ``ColumnParallelLinear``): vocabulary split over TP, after padding
  the vocabulary to a multiple of 128 * TP (megatron/training/tokenizer/tokenizer.py,
  ``_vocab_size_with_padding``, default ``--make-vocab-size-divisible-by 128``).
- Learned absolute position embedding (megatron/core/models/common/embeddings/
  language_model_embedding.py ``LanguageModelEmbedding.__init__``: ``position_embeddings`` a
  plain ``torch.nn.Embedding(max_sequence_length, hidden_size)``, "serial"): replicated, the
  whole ``[max_position_embeddings, h]`` table on every TP rank, beside the word embedding.
- MTP (megatron/core/transformer/multi_token_prediction.py): enorm, hnorm replicated, eh_proj
  column-parallel; the MTP stage also holds an embedding (megatron/core/models/gpt/gpt_model.py:
  ``if self.pre_process or self.mtp_process: self.embedding = ...``).

``paper-2502.07846`` follows the paper's stated assumptions (its section on parameter counts):
the query RoPE projection W^QR (the RoPE columns of wq_b) is replicated, with W^DQ (wq_a) and
W^DKV/W^KR (wkv_a); W^UQ (the no-RoPE columns of wq_b), W^UK/W^UV (wkv_b) and W^O (wo) are split
over TP; the shared expert is replicated on every rank (not split over TP) and, with the routed
experts, sharded by ZeRO over EDP; no vocabulary padding. Modules the paper does not analyse
(dense MLP, embedding, head, MTP) follow ``megatron``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LocalSizes", "local_sizes", "PLAN_TABLE", "padded_vocab"]

# Megatron's default --make-vocab-size-divisible-by.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class LocalSizes:
    """Sizes of one rank's modules (elements).

    Attributes:
        num_heads: attention heads held (n_h / TP).
        num_kv_heads: key/value heads (query groups) held (n_kv / TP; grouped-query
            attention; MLA's equals num_heads).
        dense_inter: dense MLP width held.
        expert_ids: the routed experts held (a contiguous range of E / EP).
        expert_inter: each routed expert's width held (moe_intermediate_size / ETP).
        shared_inter: the shared experts' width held.
        vocab: embedding rows and head columns held.
        eh_proj_out: MTP eh_proj output width held.
        replicate_q_rope: the query RoPE columns of wq_b are a separate, replicated ``wq_r``.
        tp: tensor-parallel degree; sp: the sequence-parallel degree (tp with SP, else 1);
        cp, ep, etp: context-, expert- and expert-tensor-parallel degrees. They decide which
            collectives the forward runs (``modeling.parallel.collectives``).
        shared_split: the shared experts are split over TP (so they gather the sequence).
        shared_kind: the shared experts' ZeRO group, "dense" (DP x CP) or "expert" (EDP);
            the modules declare it on their parameters (``modeling.parallel.groups``).
    """

    num_heads: int
    dense_inter: int
    expert_ids: range
    expert_inter: int
    shared_inter: int
    vocab: int
    eh_proj_out: int
    replicate_q_rope: bool = False
    tp: int = 1
    sp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    shared_split: bool = True
    shared_kind: str = "dense"
    num_kv_heads: int = 0

    @classmethod
    def full(cls, cfg) -> LocalSizes:
        """The unsharded model."""
        return cls(cfg.num_attention_heads, cfg.intermediate_size,
                   range(cfg.num_routed_experts), cfg.moe_intermediate_size,
                   cfg.shared_experts_width, cfg.vocab_size,
                   cfg.hidden_size, num_kv_heads=cfg.num_key_value_heads)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of 128 * TP."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def local_sizes(cfg, par, ep_rank: int = 0) -> LocalSizes:
    """The sizes one rank of EP rank ``ep_rank`` holds under ``par.plan``."""
    per_ep = cfg.num_routed_experts // par.ep
    experts = range(ep_rank * per_ep, (ep_rank + 1) * per_ep)
    shared = cfg.shared_experts_width
    paper = par.plan == "paper-2502.07846"
    vocab = cfg.vocab_size if paper else padded_vocab(cfg.vocab_size, par.tp)
    return LocalSizes(
        num_heads=cfg.num_attention_heads // par.tp,
        dense_inter=cfg.intermediate_size // par.tp,
        expert_ids=experts,
        expert_inter=cfg.moe_intermediate_size // par.etp,
        shared_inter=shared if paper else shared // par.tp,
        vocab=vocab // par.tp,
        eh_proj_out=cfg.hidden_size // par.tp,
        replicate_q_rope=paper,
        tp=par.tp, sp=par.tp if par.sp else 1, cp=par.cp, ep=par.ep, etp=par.etp,
        shared_split=not paper, shared_kind="expert" if paper else "dense",
        num_kv_heads=cfg.num_key_value_heads // par.tp,
    )


# module -> (megatron, paper-2502.07846), for docs/parallel.md and `tracemem static --help`.
PLAN_TABLE = {
    "attn.wq, attn.wk, attn.wv, attn.wo (grouped-query)": ("split over TP (heads, query "
                                                           "groups)", "split over TP"),
    "attn.q_norm, attn.k_norm (grouped-query, qk-norm)": ("replicated", "replicated"),
    "attn.wq_a, attn.wkv_a, attn.q_norm, attn.kv_norm": ("replicated", "replicated"),
    "attn.wq_b (no-RoPE columns, W^UQ)": ("split over TP", "split over TP"),
    "attn.wq_b (RoPE columns, W^QR)": ("split over TP", "replicated (attn.wq_r)"),
    "attn.wkv_b, attn.wo": ("split over TP", "split over TP"),
    "ffn (dense MLP)": ("split over TP", "split over TP"),
    "ffn.gate (router, correction bias)": ("replicated", "replicated"),
    "ffn.experts (routed)": ("E/EP per rank, each split over ETP; ZeRO over EDP",
                             "E/EP per rank; ZeRO over EDP"),
    "ffn.shared_experts": ("split over TP; ZeRO over DP", "replicated; ZeRO over EDP"),
    "ffn.shared_expert_gate (Qwen2-MoE)": ("replicated; ZeRO over DP", "replicated; ZeRO over DP"),
    "embed, head": ("vocabulary (padded to 128*TP) split over TP",
                    "vocabulary split over TP, no padding"),
    "position_embed (learned absolute positions)": ("replicated", "replicated"),
    "mtp.eh_proj": ("split over TP", "split over TP"),
}
