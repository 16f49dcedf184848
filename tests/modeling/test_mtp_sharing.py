"""The MTP module shares the rank's embedding and output head (DeepSeek-V3 report, arXiv
2412.19437, section 2.2: "the shared embedding layer" and "the shared output head"; section
3.2.3: under DualPipe "the shallowest layers (including the embedding layer) and deepest layers
(including the output head) of the model [sit] on the same PP rank", so MTP's embedding and
head are physically the main model's). Where the last chunk is on another rank (Megatron's
1F1B, interleaved), the MTP stage holds its own embedding copy, as Megatron-Core's GPTModel
builds it (``pre_process or mtp_process``).

Reference: hand counts of deepseek-tiny (modeling/families/deepseek/presets/deepseek-tiny.json:
vocab 256, h 64, 4 layers of which 2 dense, MLA q LoRA 48, kv LoRA 32, 4 heads of nope 16 /
rope 8 / v 16, 8 routed experts of width 32, 1 shared, dense width 128, 1 MTP module):
- attention (wq_a 64x48, q_norm 48, wq_b 48x96, wkv_a 64x40, kv_norm 32, wkv_b 32x128,
  wo 64x64): 3072 + 48 + 4608 + 2560 + 32 + 4096 + 4096 = 18,512; the layer's two norms 128;
- dense FFN 3 x 64 x 128 = 24,576: a dense layer 43,216;
- MoE: gate 8 x 64 = 512, experts 8 x 3 x 64 x 32 = 49,152 (expert-parallel group), shared
  3 x 64 x 32 = 6,144: a MoE layer 74,448 (49,152 of them experts);
- embedding = head = 256 x 64 = 16,384; final norm 64; MTP: enorm, hnorm, norm 3 x 64,
  eh_proj 128 x 64 = 8,192, its MoE layer 74,448: 82,832.
The whole model: 16,384 + 2 x 43,216 + 2 x 74,448 + 64 + 16,384 + 82,832 = 350,992 elements.
Bytes under the default --precision megatron: bf16 parameters 2 B, fp32 main grads 4 B, Adam's
fp32 master + m + v 12 B per element (DP 1: nothing sharded).
"""

import pytest

from modeling.parallel.build import build_rank
from tracemem.estimator import estimate
from tracemem.job import Job
from tracemem.schedules import placement
from tracemem.static import static_memory

EMBEDDING = 256 * 64
DENSE_LAYER, MOE_LAYER, MTP, FINAL_NORM = 43_216, 74_448, 82_832, 64
WHOLE = 350_992  # elements, by hand (module docstring)
assert WHOLE == 2 * EMBEDDING + 2 * DENSE_LAYER + 2 * MOE_LAYER + FINAL_NORM + MTP
EXPERTS = 49_152  # one MoE layer's routed experts
# the rank holding the last chunk: its layers, final norm, head, MTP (and an embedding)
LAST = FINAL_NORM + EMBEDDING + MTP + EMBEDDING


def _job(schedule: str, vpp: int = 1) -> Job:
    # rounding 0: exact bytes (the estimate's default rounds each storage to 512 B)
    return Job(model="deepseek-tiny", world_size=2, pp=2, vpp=vpp, schedule=schedule,
               seq_length=64, micro_batch_size=1, num_microbatches=4, rounding=0)


def _rank(job: Job, rank: int):
    par = job.parallel
    model = build_rank(job.config, par, rank,
                       placement=placement(job.schedule, par.pp, par.vpp, job.microbatches))
    return model, static_memory(model, par)


def _static_bytes(elements: int) -> tuple[int, int, int]:
    return 2 * elements, 4 * elements, 12 * elements


@pytest.mark.parametrize("schedule, vpp, ranks", [
    # 1F1B: stage 0 embedding + layers 0, 1; stage 1 layers 2, 3 + LAST
    ("1f1b", 1, ((EMBEDDING + 2 * DENSE_LAYER, 0), (2 * MOE_LAYER + LAST, 3))),
    # interleaved (loop): rank 0 chunks 0, 2 (layers 0, 2); rank 1 chunks 1, 3 (1, 3 + LAST)
    ("interleaved-1f1b", 2, ((EMBEDDING + DENSE_LAYER + MOE_LAYER, 1),
                             (DENSE_LAYER + MOE_LAYER + LAST, 2))),
])
def test_megatron_layouts_give_the_mtp_stage_its_own_embedding_copy(schedule, vpp, ranks):
    for rank, (elements, moe_modules) in enumerate(ranks):
        model, memory = _rank(_job(schedule, vpp), rank)
        assert (model.embed is not None) == (model.pre_process or model.post_process)
        assert memory.dense_params + memory.expert_params == elements
        assert memory.expert_params == moe_modules * EXPERTS
        assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == \
            _static_bytes(elements)
    assert sum(elements for elements, _ in ranks) == WHOLE + EMBEDDING  # the MTP stage's copy


@pytest.mark.parametrize("schedule, vpp, rank0, moe_modules", [
    ("dualpipe", 1, WHOLE, 3),  # both chunks on both ranks: the whole model each
    # V: rank 0 chunks 0 and 3 (layers 0, 3), the embedding, head and MTP (LAST with the
    # first chunk's embedding for the copy); rank 1 layers 1, 2
    ("zbv", 2, DENSE_LAYER + MOE_LAYER + LAST, 2),
    ("dualpipev", 2, DENSE_LAYER + MOE_LAYER + LAST, 2),
])
def test_rank_holding_first_and_last_chunk_declares_one_embedding_and_one_head(
        schedule, vpp, rank0, moe_modules):
    model, memory = _rank(_job(schedule, vpp), 0)
    assert model.pre_process and model.post_process and len(model.mtp) == 1
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)
             if "embed" in name or "head" in name]
    assert names == ["embed.weight", "head.weight"]  # MTP declares neither
    assert memory.by_component["embedding"] == memory.by_component["output_head"] == EMBEDDING
    assert memory.dense_params + memory.expert_params == rank0
    assert memory.expert_params == moe_modules * EXPERTS
    # against the same modules with an MTP embedding copy as well: exactly one embedding
    # less, vocab x h x 2 B of parameters, x 4 B of fp32 main grads, x 12 B of optimizer states
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == \
        _static_bytes(rank0) == tuple(
            a - b for a, b in zip(_static_bytes(rank0 + EMBEDDING), _static_bytes(EMBEDDING)))
    assert _static_bytes(EMBEDDING) == (32_768, 65_536, 196_608)
    if schedule != "dualpipe":
        _, other = _rank(_job(schedule, vpp), 1)
        assert other.dense_params + other.expert_params == WHOLE - rank0


def test_estimate_dualpipe_rank_holds_one_embedding_less_than_1f1b_stages():
    """The estimate's static bytes are Megatron's padded DDP buffers (tracemem.static,
    ``megatron_buffers``); the embedding's 16,384 elements are a multiple of the padding, so the
    difference is exactly one embedding there too."""
    dual, loop = estimate(_job("dualpipe")).ranks, estimate(_job("1f1b")).ranks
    assert [r.static.dense_params + r.static.expert_params for r in dual] == [WHOLE, WHOLE]
    assert [r.static.dense_params + r.static.expert_params for r in loop] == \
        [EMBEDDING + 2 * DENSE_LAYER, 2 * MOE_LAYER + LAST]

    def static(row):
        return row.parameter_bytes, row.gradient_bytes, row.optimizer_state_bytes

    assert tuple(a + b - c for a, b, c in zip(static(loop[0]), static(loop[1]),
                                              static(dual[0]))) == _static_bytes(EMBEDDING)
    assert static(dual[0]) == static(dual[1]) and dual[0].optimizer_state_bytes == 12 * WHOLE
