"""``tracemem inventory`` of the 16B DeepSeek-V3-architecture model of issue 10 (Moonlight-16B-A3B:
h 2048, 16 heads, MLA without q LoRA, kv_lora 512, 64 routed experts top-6 of width 1408, 2
shared, dense FFN 11264) under megatron-te at TP 2 + SP, EP 8, ETP 1, b = 1, s = 4096.

Reference: the per-layer table in docs/kernels.md, each row derived from the TE / Megatron-Core
source it cites; the totals below are that table's arithmetic, written out.
"""

import functools

import pytest

from tracemem.cli import main
from tracemem.inventory import get_inventory

LAYOUT = dict(world_size=8, tp=2, sp=True, ep=8, etp=1, micro_batch_size=1, seq_length=4096)
T, S, H = 2048, 4096, 2048  # local tokens (s / TP), gathered tokens, hidden
N, D_QK, D_V, D_R, KV = 8, 192, 128, 64, 512  # local heads (16 / TP), head dims, kv_lora_rank
BF16, F32, I32 = 2, 4, 4

ATTENTION = (
    T * H * BF16 + T * F32          # input RMSNorm: its output (saved by the down projections), rstd
    + 2 * T * KV * BF16 + T * F32   # kv up projection (LayerNormLinear): input copy, ln_out, rstd
    + 4 * S * D_R * BF16            # unfused RoPE: cos and sin casts, for q and for k
    + 2 * S * N * D_QK * BF16       # fused attention: q, k
    + 2 * S * N * D_V * BF16        # v, and the output (also linear_proj's input)
    + N * S * F32 + 2 * 8           # softmax statistics, rng state
    + T * H * BF16)                 # the residual sum after attention (saved by the next norm)


@functools.cache
def inventory(part):
    return get_inventory("moonlight-16b-a3b", part=part, **LAYOUT)


def test_moe_layer_inventory_total_by_hand():
    E, K, F = 64, 6, 1408
    R = T * K  # token-slots this EP rank receives under balanced routing
    moe = (T * F32 + T * H * BF16   # pre-MLP RMSNorm: rstd, its output (the router's input)
           + T * E * F32 + T * K * 8 + T * K * F32 + T * F32  # router: scores, top-k ids,
           # top-k weights and their sum (renormalisation), fp32
           + T * (2 * E + 1) * I32  # TE permute's row_id_map
           + 2 * R * I32            # chunk sort and unsort maps
           + R * H * BF16           # grouped fc1 input (the sorted tokens)
           + R * 2 * F * BF16 + R * F32  # weighted SwiGLU: fc1 output, probabilities
           + R * F * BF16           # grouped fc2 input
           + S * H * BF16           # shared experts (overlap): the gathered input
           + S * 2 * F * BF16       # their SwiGLU input (2 shared x 1408 / TP 2 = 1408 per half)
           + S * F * BF16           # their fc2 input
           + T * H * BF16)          # the layer output (saved by the next layer's norm)
    assert inventory("layer 1").total_bytes == ATTENTION + moe == 289_349_648


def test_dense_layer_inventory_total_by_hand():
    F = 11264 // 2  # dense FFN width per TP rank
    dense = (T * H * BF16 + T * F32      # fc1 with the pre-MLP norm fused: ln_out, rstd (its
             # input is the residual sum, counted with the attention)
             + S * 2 * F * BF16           # SwiGLU input (fc1 output)
             + S * F * BF16               # fc2 input
             + T * H * BF16)              # the layer output
    assert inventory("layer 0").total_bytes == ATTENTION + dense == 220_356_624


def test_every_megatron_te_row_cites_a_source():
    rows = inventory("layer 1").rows
    assert all(row.source != "-" for row in rows)
    assert any("TransformerEngine" in row.source for row in rows)


def test_cli_compares_two_profiles_and_rejects_a_bad_part(capsys):
    assert main(["inventory", "--model", "deepseek-tiny", "--world-size", "2", "--tp", "2",
                 "--sp", "--micro-batch-size", "1", "--seq-length", "16", "--part", "layer 3",
                 "--compare", "eager"]) == 0
    assert "totals: megatron-te" in capsys.readouterr().out
    assert main(["inventory", "--model", "deepseek-tiny", "--world-size", "1",
                 "--micro-batch-size", "1", "--seq-length", "16", "--part", "layer 9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--part 'layer 9' is invalid" in err
