"""Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198): activation bytes per transformer layer of a GPT-style model with 16-bit
activations, s sequence length, b micro-batch size, h hidden size, a attention heads, t TP size
(section 4, Table 2), and the pipeline first-stage factors (section 4.2.3).
"""

from __future__ import annotations

__all__ = ["per_layer", "first_stage_total", "RECOMPUTE_CASES"]

RECOMPUTE_CASES = ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full")


def per_layer(s: int, b: int, h: int, a: int, t: int = 1, case: str = "none") -> float:
    """Activation bytes of one layer (Table 2):
    none: sbh(34 + 5as/h); tp: sbh(10 + 24/t + 5as/(ht)); tp_sp: sbh/t (34 + 5as/h);
    tp_selective: sbh(10 + 24/t); tp_sp_selective: 34 sbh / t; full: 2sbh."""
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp_sp": sbh / t * (34 + 5 * a * s / h),
        "tp_selective": sbh * (10 + 24 / t),
        "tp_sp_selective": 34 * sbh / t,
        "full": 2 * sbh,
    }[case]


def first_stage_total(layer_bytes: float, num_layers: int, pp: int, m: int = 0,
                      vpp: int = 1) -> float:
    """The first pipeline stage's activations (section 4.2.3): 1F1B holds pp microbatches of
    L / pp layers, i.e. L layers' worth; interleaving multiplies by 1 + (pp - 1) / (pp * vpp)
    (Megatron's interleaved schedule, m microbatches >= pp)."""
    total = layer_bytes * num_layers
    return total if vpp == 1 else total * (1 + (pp - 1) / (pp * vpp))
