"""``what_fits``: for a job whose worst rank does not fit in ``--hbm``, re-run ``estimate`` with
one setting changed at a time and report each change's worst peak. Every figure is estimated
(a full ``estimate`` of every stage), none is guessed or scaled.

The changes tried, each on its own, at most eight (a bounded search, about one estimate each):
- ``--recompute selective`` (Megatron's default module, core_attn) when recompute is none;
- ``--recompute full`` unless it is already full;
- ``--micro-batch-size b/2`` with ``--num-microbatches 2M`` (the global batch b x M x DP kept)
  when b is even;
- the next ZeRO stage, and ZeRO-3, when higher than the current one;
- ``--optimizer-cpu-offload`` (Megatron's hybrid device optimizer, the job's
  ``--optimizer-offload-fraction``, 1.0 by default: every optimizer state on the host), with
  ``--use-precision-aware-optimizer`` where the job has not got it (Megatron's
  ``validate_args`` asks for it), when the job does not offload already;
- ``--ep 2 x EP`` (EDP halves; dense DP and the global batch unchanged), for an MoE model;
- ``--pp 2 x PP`` with ``--num-microbatches 2M`` (DP halves, so 2M keeps the global batch)
  and a layout that the validator accepts (``tracemem.parallel.suggest_ends`` /
  ``suggest_layout``).
A change the validator rejects (EP not dividing the experts, a world size that is no longer a
multiple) is reported as skipped with the validator's own message.

A change that raises the worst peak says why in its note, from the two estimates: selective
recompute can (``selective_note``), on a grouped-query or multi-head attention under Megatron
orchestration: its checkpoint keeps core attention's inputs for the recompute, and the value
is a strided slice of ``linear_qkv``'s fused output (Megatron-LM d98e8a6
megatron/core/transformer/attention.py ``SelfAttention.get_query_key_value_tensors``,
``torch.split``), so that whole output, queries, keys and values, stays alive, where
without recompute TE's fused attention keeps a contiguous copy of the value and the output
is freed (``modeling.common.attention.gqa``, ``_forward_megatron``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tracemem.errors import TracememError

__all__ = ["FitCandidate", "what_fits", "selective_note"]

@dataclass(frozen=True)
class FitCandidate:
    """One single change and its re-estimated outcome (plain data; ``as_dict`` for JSON).

    Attributes:
        change: the flags to add or replace, as typed on the command line.
        changes: the ``Job`` fields changed, with their new values.
        note: why more than one flag changes (the global batch kept), or "".
        skipped: the validator's message when the change is not possible here, else None.
        worst_peak_bytes, worst_pp_stage, worst_ep_rank: the worst rank of the re-estimate
            (None when skipped).
        worst_needed_bytes: the most a rank needs (reserved peak + non-PyTorch memory, what
            ``hbm`` is judged on).
        stages_over_hbm: pipeline stages with a rank still over ``hbm``.
        fits: every rank fits in ``hbm``.
        megatron_change: for a job that came in as Megatron-LM arguments, the arguments to
            change (``tracemem.frontdoors.megatron_flag_changes``), else "".
    """

    change: str
    changes: dict[str, Any]
    note: str = ""
    skipped: str | None = None
    worst_peak_bytes: int | None = None
    worst_pp_stage: int | None = None
    worst_ep_rank: int | None = None
    worst_needed_bytes: int | None = None
    stages_over_hbm: list[int] = field(default_factory=list)
    fits: bool = False
    megatron_change: str = ""  # the same change as Megatron-LM arguments (a Megatron job)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["changes"] = {k: list(v) if isinstance(v, tuple) else v
                          for k, v in self.changes.items()}
        return out


def _candidates(job) -> list[tuple[str, dict[str, Any], str, str | None]]:
    """``(flags, Job field changes, note, skipped)`` of every single change to try."""
    from tracemem.parallel import format_layout, suggest_ends, suggest_layout

    par = job.parallel
    b, m = job.micro_batch_size, job.microbatches
    out: list[tuple[str, dict[str, Any], str, str | None]] = []
    if job.recompute == "none":
        out.append(("--recompute selective", {"recompute": "selective"}, "", None))
    if job.recompute != "full":
        out.append(("--recompute full", {"recompute": "full"}, "", None))
    if b % 2 == 0:
        out.append((f"--micro-batch-size {b // 2} --num-microbatches {2 * m}",
                    {"micro_batch_size": b // 2, "num_microbatches": 2 * m},
                    "--num-microbatches doubles where b halves or DP halves: the same global "
                    "batch", None))
    else:
        out.append(("a smaller --micro-batch-size", {}, "",
                    f"--micro-batch-size {b} cannot be halved"))
    for zero in sorted({par.zero + 1, 3}):
        if par.zero < zero <= 3:  # ZeRO-3 is the last stage: nothing above it to try
            out.append((f"--zero {zero}", {"zero": zero}, "", None))
    if not job.optimizer_cpu_offload:  # the Job refuses it where it is not modelled
        flags, changes = "--optimizer-cpu-offload", {"optimizer_cpu_offload": True}
        note = ""
        if not par.precision_spec.use_precision_aware_optimizer:
            flags += " --use-precision-aware-optimizer"
            changes["use_precision_aware_optimizer"] = True
            note = ("--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron's "
                    "validate_args)")
        out.append((flags, changes, note, None))
    if job.config.is_moe:  # a dense model has no experts to spread
        out.append((f"--ep {2 * par.ep}", {"ep": 2 * par.ep}, "", None))
    pp, stages = 2 * par.pp, 2 * par.pp * par.vpp
    layers = job.config.num_layers
    if stages > layers:
        out.append((f"--pp {pp}", {}, "", f"pp * vpp = {stages} stages is more than the "
                                           f"model's {layers} layers"))
        return out
    # a new PP: the given layout's fields give way to the new one
    changes: dict[str, Any] = {"pp": pp, "num_microbatches": 2 * m, "pp_layout": None,
                               "pp_first_stage_layers": None, "pp_last_stage_layers": None,
                               "account_for_embedding_in_pipeline_split": False,
                               "account_for_loss_in_pipeline_split": False}
    if layers % stages == 0:
        flags = ""
    elif par.vpp == 1:
        first, last = suggest_ends(layers, stages)
        changes |= {"pp_first_stage_layers": first, "pp_last_stage_layers": last}
        flags = f" --pp-first-stage-layers {first} --pp-last-stage-layers {last}"
    else:
        layout = suggest_layout(layers, stages)
        changes["pp_layout"] = layout
        flags = f" --pp-layout {format_layout(layout)}"
    out.append((f"--pp {pp}{flags} --num-microbatches {2 * m}", changes,
                "--num-microbatches doubles where b halves or DP halves: the same global batch",
                None))
    return out


def selective_note(base, result) -> str:
    """Why ``--recompute selective`` (``result``) has a higher worst peak than ``base`` (none),
    in one line with the activations of the two worst stages, or "" when it is not higher."""
    from tracemem.report import _size_label, pick_units

    before, after = base.worst, result.worst
    if after.peak_bytes <= before.peak_bytes:
        return ""
    same = next((r for r in base.ranks if r.pp_stage == after.pp_stage
                 and r.ep_rank == after.ep_rank), before)
    units = pick_units(after.peak_bytes)
    more = _size_label(after.activation_bytes - same.activation_bytes, units)
    line = (f"--recompute selective raises the peak: activations {more} more at stage "
            f"{after.pp_stage}; its checkpoint keeps core attention's inputs for the recompute")
    cfg, profile = base.job.config, base.job.profile
    if not cfg.is_mla and profile.orchestration == "megatron":
        line += (", and the value, a slice of linear_qkv's fused output (Megatron's "
                 "torch.split), keeps that whole output alive, where without recompute TE's "
                 "fused attention keeps a contiguous copy of the value")
    return line


def what_fits(base, *, progress: Callable[[str], None] | None = None,
              trace_cache=None) -> list[FitCandidate]:
    """Re-estimate ``base`` (an ``Estimate`` with an ``hbm``) with one setting changed at a
    time (the module docstring lists them), each a new ``Job`` made with
    ``dataclasses.replace`` from ``base.job``, and return every candidate, those that fit
    first, then by worst peak.

    Args:
        base: the ``Estimate`` to improve on; its job needs ``hbm``.
        progress: called with a message before each re-estimate.
        trace_cache: a ``TraceCache`` shared with ``base``'s estimate (rank classes whose
            traces a change leaves alone are not traced again).

    Raises:
        TracememError: ``base`` has no ``hbm`` to fit in.
    """
    from dataclasses import replace

    from tracemem.estimator import estimate
    from tracemem.report import get_verdict

    if base.hbm_bytes is None:
        raise TracememError("what_fits needs hbm (e.g. --hbm 80GiB): the memory to fit in")
    found = []
    todo = _candidates(base.job)
    for index, (flags, changes, note, skipped) in enumerate(todo):
        if skipped is not None:
            found.append(FitCandidate(flags, changes, note, skipped))
            continue
        megatron = ""
        try:
            job = replace(base.job, **changes)  # validated: a change it refuses is skipped
            if job.origin == "megatron":
                from tracemem.frontdoors import megatron_flag_changes

                megatron = megatron_flag_changes(changes, job=base.job)
            result = estimate(job, trace_cache=trace_cache)
        except TracememError as error:
            found.append(FitCandidate(flags, changes, note, str(error).splitlines()[0],
                                      megatron_change=megatron))
            continue
        if changes == {"recompute": "selective"}:
            note = selective_note(base, result) or note
        # judged as the estimate judges --hbm: reserved peak + non-PyTorch memory (r.fits)
        verdict = get_verdict(result)
        over = verdict["stages_over_hbm"]
        found.append(FitCandidate(flags, changes, note, None, verdict["worst_peak_bytes"],
                                  verdict["worst_pp_stage"], verdict["worst_ep_rank"],
                                  verdict["worst_needed_bytes"], over, not over, megatron))
    tried = sorted((c for c in found if c.skipped is None),
                   key=lambda c: (not c.fits, c.worst_peak_bytes))
    return tried + [c for c in found if c.skipped is not None]
