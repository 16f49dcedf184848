"""Each dense family's tiny config run for real on CPU against the same step traced on meta,
eager profile (issue 12, "Must show").

Reference: the CPU allocator under torch.profiler (tracemem.validation.groundtruth), as in
tests/modeling/test_real_step.py for deepseek-tiny. Dense models route nothing, so the meta
step has the real step's shapes with no counts file.
"""

import pytest

from modeling import load_config
from tracemem.validation import model_step_real_and_traced


# The peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest parameter:
# the Python float wrapped as a float64 CPU tensor (8 B) and its float32 copy (4 B), both
# below the dispatcher (tests/modeling/test_real_step.py).
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_traced_meta_step_matches_the_real_cpu_step(preset):
    cfg = load_config(preset)
    real, peak, end = model_step_real_and_traced(cfg)
    assert real.peak_bytes - peak == 8 + 4
    assert real.end_bytes == end
