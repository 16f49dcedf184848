"""Megatron-Core 0.16.1 itself against tracemem for every ``--recompute-modules`` value and
for full recompute with ETP 2 (issue 22 item 2), through the oracle's public ``run_case``.

Reference: megatron-core 0.16.1 run on meta (``tracemem.oracle.compare``), its orchestration
deciding what each layer keeps; the expected differences, Megatron-Core minus tracemem per
layer, derived by hand below from the cited source. Layout TP 2 + SP, EP 4 (ETP 2 where
named), b = 1, s = 16, deepseek-tiny with 3 layers (layer 0 dense): T = 16 / 2 = 8 tokens
per rank, E = 8 experts, d_r = 8, h = 64.

Three things the oracle needs that this file supplies itself (each a change asked of
``tracemem/oracle``, see the report of issue 22):
- 0.16.1's ``CheckpointWithoutOutput()`` sets ``self.fp8 = fp8 is not None`` (True for the
  default False) and then calls TE's ``FP8GlobalStateManager``, absent here: ``layernorm`` and
  ``moe_act`` recompute raise NameError. ``self.fp8`` is set False (bf16: the FP8 context
  does no memory work).
- ``shared_experts`` recompute needs ``--moe-shared-expert-overlap`` off on both sides.
- Megatron-LM d98e8a6 (the pinned commit tracemem models) restores a discarded output by
  pointing its storage at the recomputed data (``share_storage``); 0.16.1 resizes the storage
  back and copies into it while the recomputed output is still held. Both are checked:
  0.16.1 as installed (the copy itemised), and 0.16.1 with d98e8a6's ``_recompute``
  (equal).
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

from tracemem.oracle.compare import OracleCase, run_case  # noqa: E402

T, E, S, D_R, H = 8, 8, 16, 8, 64
ROPE_CACHE = S * D_R * 4  # RotaryEmbedding.forward's lru_cache'd emb [s, 1, 1, d_r] fp32: 512
PROBS = T * E * 4  # token_dispatcher.py dispatch_preprocess keeps self.probs [T, E] fp32: 256
ROUTING_MAP = T * E  # ... and self.routing_map [T, E] bool: 64
ROW_ID_MAP = T * (2 * E + 1) * 4  # self.reversed_local_input_permutation_mapping: 544


def _expected(layer: int, moe_checkpointed: bool) -> tuple[int, int, int]:
    """(kept, forward peak, backward peak), Megatron-Core minus tracemem, of ``layer`` from the
    dispatcher's state and the RoPE cache alone (tracemem counts neither: both outlive the
    microbatch). ``moe_checkpointed``: the MoE layer's forward ran under no_grad
    (``CheckpointFunction``: full or ``moe`` recompute), so the unpermute did not save the
    row-id map, which the dispatcher keeps on Megatron's side; in backward the recompute
    replaces the probabilities and the row-id map, freed before the backward peak."""
    if layer == 0:  # dense
        return ROPE_CACHE, ROPE_CACHE, 0
    kept = ROPE_CACHE + PROBS + ROUTING_MAP
    if moe_checkpointed:
        return kept + ROW_ID_MAP, ROPE_CACHE + ROUTING_MAP, -(PROBS + ROW_ID_MAP)
    return kept, ROPE_CACHE + ROUTING_MAP, 0


def _diffs(result) -> dict[int, tuple[int, int, int]]:
    out = {}
    for layer, m in result.megatron.items():
        t = result.tracemem[layer]
        assert m.params == t.params
        out[layer] = (m.kept - t.kept, m.forward_peak - t.forward_peak,
                      m.backward_peak - t.backward_peak)
    return out


@pytest.fixture(autouse=True)
def _no_fp8(monkeypatch):
    from megatron.core.tensor_parallel import random

    init = random.CheckpointWithoutOutput.__init__

    def no_fp8(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False
    monkeypatch.setattr(random.CheckpointWithoutOutput, "__init__", no_fp8)


def _d98e8a6_recompute(monkeypatch):
    """Megatron-LM d98e8a6 ``CheckpointWithoutOutput._recompute``: recompute, then each
    discarded output's storage aliases the recomputed one (``share_storage``, zero copy: on
    meta, nothing to resize); ``ctx.outputs`` holds the recomputed outputs for the
    checkpoint's backward. The RNG fork is left out (no RNG state on meta)."""
    from megatron.core.tensor_parallel import random

    def recompute(self, _):
        if self.ctx is None:
            return
        inputs = []
        for t in self.ctx.saved_tensors:  # None where None was passed (fc1's absent bias)
            d = t
            if isinstance(t, torch.Tensor):
                d = t.detach()
                d.requires_grad_(t.requires_grad)
            inputs.append(d)
        with torch.enable_grad():
            outputs = self.run_function(*inputs)
        self.run_function = self.rng_states = None
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        self.ctx.outputs, self.ctx.inputs = outputs, tuple(inputs)
        self.outputs = self.ctx = None
    monkeypatch.setattr(random.CheckpointWithoutOutput, "_recompute", recompute)


def _no_shared_overlap(monkeypatch):
    import megatron.core.transformer.transformer_config as tc

    import modeling.kernels

    config, profile = tc.MLATransformerConfig, modeling.kernels.get_profile
    monkeypatch.setattr(tc, "MLATransformerConfig",
                        lambda **kw: config(**{**kw, "moe_shared_expert_overlap": False}))
    monkeypatch.setattr(modeling.kernels, "get_profile", lambda *a, **kw: profile(
        *a, **{**kw, "moe_shared_expert_overlap": False}))


LAYOUT = dict(tp=2, sp=True, ep=4)


@pytest.mark.parametrize("module", ["core_attn", "mlp", "moe", "shared_experts"])
def test_reentrant_modules_equal_megatron_core(module, monkeypatch):
    """core_attn (attention.py), mlp (transformer_layer.py ``_run_mlp``), moe (moe_layer.py
    ``MoELayer.forward``), shared_experts (``shared_experts_compute``): Megatron's reentrant
    ``tensor_parallel.checkpoint`` on both sides; nothing differs but the dispatcher's state
    and the RoPE cache."""
    if module == "shared_experts":
        _no_shared_overlap(monkeypatch)
    result = run_case(OracleCase(recompute="selective", modules=(module,), **LAYOUT))
    assert _diffs(result) == {i: _expected(i, module == "moe") for i in range(3)}


@pytest.mark.parametrize("module", ["layernorm", "moe_act", "mla_up_proj"])
def test_output_discarding_modules_equal_megatron_at_the_pinned_commit(module, monkeypatch):
    """layernorm, moe_act, mla_up_proj: ``CheckpointWithoutOutput`` on both sides; with
    d98e8a6's zero-copy restore nothing differs but the dispatcher's state and the RoPE
    cache."""
    _d98e8a6_recompute(monkeypatch)
    result = run_case(OracleCase(recompute="selective", modules=(module,), **LAYOUT))
    assert _diffs(result) == {i: _expected(i, False) for i in range(3)}


def test_megatron_core_0_16_1_copies_restored_outputs():
    """0.16.1's ``_recompute`` (tensor_parallel/random.py) resizes each discarded output's
    storage back and copies the recomputed one into it while ``ctx.outputs`` still holds the
    recomputed one: two copies during that part of backward, where d98e8a6 holds one.
    - layernorm: on the MoE layers the pre-MLP norm's output [T, 1, h] = 8 x 64 x 2 = 1,024 B
      is restored at the start of the MoE backward, the layer's backward peak: +1,024 B; on
      the dense layer the input norm's restored output is not at the layer's peak (the MLP's
      backward is): 0.
    - moe_act: fc2's input, restored inside the experts' backward, below the
      layer's peak: 0.
    - mla_up_proj: query, key and value (2 x [16, 1, 2, 24] + [16, 1, 2, 16] bf16 = 4,096 B)
      restored at core attention's backward: Megatron's peak is there, tracemem's later (the
      up projections' backward); the difference is positive and at most the 4,096 B copy."""
    diffs = {m: _diffs(run_case(OracleCase(recompute="selective", modules=(m,), **LAYOUT)))
             for m in ("layernorm", "moe_act", "mla_up_proj")}
    base = {i: _expected(i, False) for i in range(3)}
    copy = {0: 0, 1: 1024, 2: 1024}
    assert diffs["layernorm"] == {i: base[i][:2] + (copy[i],) for i in range(3)}
    assert diffs["moe_act"] == base
    qkv = 2 * 16 * 2 * 24 * 2 + 16 * 2 * 16 * 2
    assert qkv == 4096
    for i in range(3):
        assert diffs["mla_up_proj"][i][:2] == base[i][:2]
        assert 0 <= diffs["mla_up_proj"][i][2] <= qkv
    assert max(diffs["mla_up_proj"][i][2] for i in range(3)) > 0


@pytest.mark.parametrize("etp", [1, 2])
def test_full_recompute_equals_megatron_core(etp):
    """Full recompute (uniform, 1 layer; recompute.py ``checkpointed_forward``), ETP 1 and 2.
    With ETP 2 the sorted tokens [2T x 2, h] and permuted probabilities stay bound in
    ``MoELayer.routed_experts_compute`` through ``combine_preprocess`` (unsort, fp32 cast,
    reduce-scatter) in the no_grad forward, on both sides."""
    result = run_case(OracleCase(recompute="full", etp=etp, **LAYOUT))
    assert _diffs(result) == {i: _expected(i, True) for i in range(3)}
