"""``build_rank``: the modules one rank holds, with its local shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.common.config import ModelConfig
from modeling.common.custom import resolve_replacements
from modeling.kernels import KernelProfile, get_profile
from modeling.common.model import Transformer, cast_parameters, resolve_experts
from modeling.parallel.plans import local_sizes

__all__ = ["RankCoordinates", "coordinates", "build_rank"]


@dataclass(frozen=True)
class RankCoordinates:
    """Where a global rank sits: its pipeline stage, its rank in the dense groups (TP, CP, DP)
    and in the expert groups (ETP, EP, EDP). Megatron's default order: TP (ETP) fastest, then
    CP, DP (EP, EDP), then PP."""

    rank: int
    pp_rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    etp_rank: int
    ep_rank: int
    edp_rank: int


def coordinates(par, rank: int) -> RankCoordinates:
    """The coordinates of global ``rank`` in layout ``par``.

    Raises:
        TracememError: rank outside [0, world_size).
    """
    stage = par.stage_of(rank)
    local = rank % (par.world_size // par.pp)
    return RankCoordinates(
        rank, stage,
        tp_rank=local % par.tp, cp_rank=(local // par.tp) % par.cp,
        dp_rank=local // (par.tp * par.cp),
        etp_rank=local % par.etp, ep_rank=(local // par.etp) % par.ep,
        edp_rank=local // (par.etp * par.ep))


def build_rank(model_cfg: ModelConfig, par, rank: int, *, attention: str = "flash",
               experts: str = "auto", device: str | torch.device = "meta",
               dtype: torch.dtype | None = None,
               kernels: str | KernelProfile = "eager", placement=None,
               replace=None) -> Transformer:
    """The part of the model that global rank ``rank`` holds under ``par`` (a validated
    ``tracemem.ParallelConfig``): the layers of its pipeline stage (one chunk per virtual
    stage, global layer numbers kept in module paths), the embedding on the first stage, the
    final norm, head, loss and MTP modules on the last, every module at this rank's shard
    shapes under ``par.plan`` (``modeling.parallel.plans``), running the ``kernels`` profile
    (``modeling.kernels``; default "eager"). ``placement`` (a ``tracemem.schedules.Placement``;
    default Megatron's loop) says which chunks the rank holds: the embedding comes with chunk
    0, the head and loss with the last chunk. ``replace``: the user's own layers
    (``modeling.common.custom``; each factory gets this rank's ``LayerContext``, ``rank`` its
    ``RankCoordinates``).

    Raises:
        TracememError: rank outside [0, world_size); "grouped" experts with parameters that are
            not bfloat16; a bad ``replace``.
    """
    where = coordinates(par, rank)
    sizes = local_sizes(model_cfg, par, where.ep_rank)
    chunks = par.layers_of_stage(where.pp_rank, placement)
    held = (placement.chunks_of(where.pp_rank) if placement is not None
            else range(where.pp_rank, par.num_virtual_stages, par.pp))
    dtype = dtype or getattr(torch, model_cfg.dtype)
    replacements = resolve_replacements(replace)
    with torch.device(device):
        kind = resolve_experts(experts, dtype, (model_cfg.hidden_size, sizes.expert_inter))
        model = Transformer(model_cfg, attention, kind, sizes, chunks,
                            pre_process=0 in held,
                            post_process=par.num_virtual_stages - 1 in held,
                            kernels=get_profile(kernels), replace=replacements, rank=where)
    cast_parameters(model, dtype)
    return model
