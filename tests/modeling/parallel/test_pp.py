"""Pipeline stage buffers and Megatron's output deallocation.

Reference: hand arithmetic of deepseek-tiny shapes (h 64) at b = 2, s = 32 in bfloat16, and
Megatron-LM's deallocate_output_tensor (the sent output's data is freed, its graph kept).
"""

import torch

from modeling import load_config
from modeling.parallel.build import build_rank
from modeling.parallel.pp import (
    backward_from,
    recv_backward,
    recv_forward,
    send_forward,
)
from modeling.common.routing import Balanced
from tracemem import MemoryTracer
from tracemem.parallel import ParallelConfig

CFG = load_config("deepseek-tiny")
B, S, H = 2, 32, 64
PAR = ParallelConfig.create(CFG, world_size=2, pp=2)


def middle_stage_step(deallocate):
    model = build_rank(CFG, PAR, rank=0, dtype=torch.bfloat16)  # first stage: layers 0-1
    tokens = torch.zeros(B, S, dtype=torch.long, device="meta")
    tracer = MemoryTracer()
    tracer.track_external(model, tokens)
    with tracer:
        output = model(tokens, tokens, Balanced())  # (b, s, h) hidden states
        send_forward(output, deallocate)
        after_send = tracer.current_bytes
        backward_from(output, recv_backward((B, S, H), torch.bfloat16))
    return tracer, after_send


def test_received_input_is_a_comm_buffer_that_requires_grad():
    x = recv_forward((B, S, H), torch.bfloat16)
    tracer = MemoryTracer()
    with tracer:
        y = recv_forward((B, S, H), torch.bfloat16)
    assert x.requires_grad and y.requires_grad
    assert tracer.by_category(at="now") == {"comm_buffer": B * S * H * 2}


def test_deallocating_the_sent_output_frees_its_bytes_and_backward_still_runs():
    kept, kept_after_send = middle_stage_step(deallocate=False)
    freed, freed_after_send = middle_stage_step(deallocate=True)
    # the (2, 32, 64) bf16 output (8,192 B) gives way to a 1-element bf16 tensor (2 B)
    assert kept_after_send - freed_after_send == B * S * H * 2 - 2
    assert any(e.phase.value == "backward" and e.category.value == "gradient"
               for e in freed.events)
    assert kept.peak_bytes - freed.peak_bytes == B * S * H * 2 - 2
