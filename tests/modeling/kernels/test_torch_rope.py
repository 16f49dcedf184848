"""The torch profile's RoPE is torchtitan's ComplexRoPE: the same allocations, forward and
backward, and nothing kept for backward but the cache (issue 25, fault a).

Reference: torchtitan 0.3.0 ``torchtitan/models/common/rope.py`` ``ComplexRoPE``
(``_precompute_cache``, ``apply_rotary_emb``) run on meta under ``MemoryTracer`` beside
``modeling.kernels.rope.complex_rope``; bytes by hand for the llama3 debugmodel's head (d 16)
at b 1, s 16, 16 heads: q and k ``(1, 16, 16, 16)`` bf16 = 8,192 B each, fp32 16,384 B.
"""

import pytest
import torch

from modeling.common.rope import inv_freq
from modeling.kernels import get_profile
from modeling.kernels.rope import complex_rope, complex_rope_cache
from tracemem.tracer import MemoryTracer

B, S, N, D = 1, 16, 16, 16


def _trace(fn, cache, *state):
    q, k = (torch.empty(B, S, N, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
            for _ in range(2))
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(cache, *state, q, k)
    with tracer:
        xq, xk = fn(q, k, cache)
        forward = len(tracer.events)
        # made in forward and alive after it, the two outputs included
        kept = sorted(i.nbytes for i in tracer.live_at(forward - 1)
                      if i.phase.value == "forward")
        (xq.float().sum() + xk.float().sum()).backward()
    def of(events):
        return [(e.action, e.nbytes, str(e.dtype)) for e in events
                if e.phase.value != "external"]
    return of(tracer.events[:forward]), kept, of(tracer.events)


def test_cache_is_torchtitans_freqs_cis():
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")
    from torchtitan.models.common.rope import ComplexRoPE

    rope = ComplexRoPE(ComplexRoPE.Config(dim=D, max_seq_len=S))
    cache = complex_rope_cache(inv_freq(D), S)
    assert cache.shape == rope.cache.shape == (S, D // 2)
    assert cache.dtype == rope.cache.dtype == torch.complex64
    assert torch.allclose(cache, rope.cache)  # on CPU: the same values


def test_allocations_equal_torchtitans_complex_rope():
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")
    from torchtitan.models.common.rope import ComplexRoPE

    with torch.device("meta"):
        rope = ComplexRoPE(ComplexRoPE.Config(dim=D, max_seq_len=S))
    theirs = _trace(lambda q, k, cache: rope(q, k), rope.cache)
    ours = _trace(complex_rope, complex_rope_cache(inv_freq(D).to("meta"), S))
    assert ours == theirs
    forward, kept, _ = ours
    # q.float(), k.float() (16,384 B fp32 each), the complex products (16,384 B complex64
    # each), the bf16 casts (8,192 B each, the outputs); the fp32 and complex temporaries
    # freed; nothing kept but the two outputs (the product's backward needs only the cache)
    allocs = [n for a, n, _ in forward if a == "alloc"]
    assert allocs == [16_384] * 4 + [8_192] * 2
    assert kept == [8_192, 8_192]


def test_torch_profile_runs_it_and_eager_keeps_rotate_half():
    torch_kernels, eager = get_profile("torch"), get_profile("eager")
    freqs = inv_freq(D).to("meta")
    assert eager.rope_cache(freqs, S) is None
    cache = torch_kernels.rope_cache(freqs, S)
    assert cache.shape == (S, D // 2) and cache.dtype == torch.complex64
    _, kept, _ = _trace(lambda q, k, c: torch_kernels.rope_qk(q, k, freqs, c), cache, freqs)
    assert kept == [8_192, 8_192]  # the outputs only
    # the eager rotate-half form keeps bf16 cos and sin casts (1, 16, 1, 16) for q and k:
    # 4 x 16 x 16 x 2 = 4 x 512 B, beside the outputs
    _, kept, _ = _trace(lambda q, k, c: eager.rope_qk(q, k, freqs, None), cache, freqs)
    assert kept == [512] * 4 + [8_192, 8_192]
