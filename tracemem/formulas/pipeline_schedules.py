"""Closed forms of pipeline schedules' memory: parameters per device and activations (in
microbatch-stages) held at the peak.

Sources:
- DeepSeek-V3 technical report (arXiv 2412.19437), section 3.2.1, Table 2: 1F1B 1x parameters
  and PP activations; ZB1P 1x and PP; DualPipe 2x and PP + 1 (PP: pipeline stages).
- DualPipe README (deepseek-ai/DualPipe 3da1bbe), "Pipeline Bubbles and Memory Usage
  Comparison (based on the same number of PP stages)": the same three rows, and DualPipeV 2x
  and PP + 1 on PP / 2 devices.
- Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241): ZB-H1 keeps 1F1B's
  peak activation memory, p M_B (section 3.1); ZB-V, two model chunks per worker in a V, the
  same p M_B (section 6), here counted in chunks of half a worker's stage: 2 p.
- Megatron-LM (megatron/core/pipeline_parallel/schedules.py,
  ``forward_backward_pipelining_without_interleaving``): rank p of PP runs min(PP - p - 1, M)
  warm-up forwards, so holds min(PP - p, M); Table 2's PP is the first rank's.
"""

from __future__ import annotations

__all__ = ["TABLE_2", "parameter_multiple", "activation_multiple"]

# DeepSeek-V3 report Table 2 (and the DualPipe README for dualpipev, Qi et al. for zbv):
# schedule -> (parameter multiple, activations as a function of PP stages)
TABLE_2 = {
    "1f1b": (1, lambda stages: stages),
    "zb-h1": (1, lambda stages: stages),          # "ZB1P"
    "dualpipe": (2, lambda stages: stages + 1),
    "dualpipev": (2, lambda stages: stages + 1),  # PP stages on PP / 2 devices
    "zbv": (2, lambda stages: stages),            # 2 chunks per device; p M_B = PP chunks
}


def parameter_multiple(schedule: str) -> int:
    """Parameters per device against one pipeline stage's, with the same number of stages."""
    return TABLE_2[schedule][0]


def activation_multiple(schedule: str, pp: int) -> int:
    """Microbatch-stages (model chunks) of activations at the peak of the most loaded device,
    with ``pp`` devices: 1F1B and ZB1P hold PP = pp stages, DualPipe pp + 1; DualPipeV and
    ZB-V put 2 pp stages on pp devices, holding 2 pp + 1 and 2 pp of them."""
    stages = pp * (2 if schedule in ("dualpipev", "zbv") else 1)
    return TABLE_2[schedule][1](stages)
