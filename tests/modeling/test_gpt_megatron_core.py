"""The learned-absolute-position embedding under megatron-te against Megatron-Core's own
``LanguageModelEmbedding``.

Reference: megatron-core 0.16.1 (the `megatron` extra; its language_model_embedding.py is
Megatron-LM d98e8a6's but for the MuP scaling and the process-group argument)
``LanguageModelEmbedding(position_embedding_type="learned_absolute")`` built and run on meta
under a fake process group (tracemem.oracle.megatron_patches), its parameters cast to bf16 as
``Float16Module`` does in training. Its hidden-sized storages (the word and position
embeddings, their sum, the [s, b, h] copy, the sequence-parallel clone) must be allocated and
freed in the same order, at the same sizes, as tracemem's ``Transformer._embed``. What is
left out, on purpose: the vocabulary-parallel masking's (b, s) int64 / bool tensors (tracemem
models none of them, for any position embedding) and the position ids, an input of Megatron's
batch and made by tracemem's forward.
"""

import dataclasses
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

import torch  # noqa: E402

from modeling import load_config  # noqa: E402
from modeling.common.model import Transformer  # noqa: E402
from modeling.kernels import get_profile  # noqa: E402
from modeling.parallel.plans import LocalSizes, padded_vocab  # noqa: E402
from tracemem import MemoryTracer  # noqa: E402
from tracemem.oracle import megatron_patches as patches  # noqa: E402

S = 16


def _hidden_events(module, run, inputs):
    """(action, bytes, dtype) of every storage of hidden width that ``run()`` allocates or
    frees, and the peak of those bytes above the start."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(module, *inputs)
    start = len(tracer.events)
    with tracer:
        out = run()
    events = [e for e in tracer.events[start:] if len(e.shape) == 3]
    live = peak = 0
    for e in events:
        live += e.nbytes if e.action == "alloc" else -e.nbytes
        peak = max(peak, live)
    return [(e.action, e.nbytes, e.dtype) for e in events], peak, out


def _megatron(cfg, tp, b):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings(), patches.fake_process_groups(world_size=tp, tp=tp), \
            patches.applied():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=1, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads, tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1, bf16=True, params_dtype=torch.bfloat16,
            perform_initialization=False, use_cpu_initialization=True, hidden_dropout=0.0)
        with torch.device("meta"):
            embedding = LanguageModelEmbedding(
                config, vocab_size=padded_vocab(cfg.vocab_size, tp),
                max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="learned_absolute").to(torch.bfloat16)
        tokens = torch.zeros(b, S, dtype=torch.long, device="meta")
        positions = torch.zeros(b, S, dtype=torch.long, device="meta")
        return _hidden_events(embedding, lambda: embedding(tokens, positions),
                              (tokens, positions))


def _tracemem(cfg, tp, b):
    sizes = dataclasses.replace(LocalSizes.full(cfg), vocab=padded_vocab(cfg.vocab_size, tp)
                                // tp, tp=tp, sp=tp)
    with torch.device("meta"):
        model = Transformer(cfg, sizes=sizes, kernels=get_profile("megatron-te"),
                            post_process=False).to(torch.bfloat16)
    tokens = torch.zeros(b, S, dtype=torch.long, device="meta")
    return _hidden_events(model, lambda: model._embed(tokens, model._positions(tokens)),
                          (tokens,))


@pytest.mark.parametrize("tp, b", [(2, 2), (2, 1), (1, 2)])
def test_learned_positions_allocate_and_free_as_language_model_embedding(tp, b):
    cfg = load_config("gpt-tiny")
    megatron, megatron_peak, megatron_out = _megatron(cfg, tp, b)
    tracemem, tracemem_peak, tracemem_out = _tracemem(cfg, tp, b)
    assert megatron == tracemem and megatron_peak == tracemem_peak
    assert megatron_out.numel() == tracemem_out.numel() == b * S // tp * cfg.hidden_size
    # by hand at TP 2 + SP, b 2, h 64, bf16: word, position, their sum and its [s, b, h] copy
    # alive at once, 4 * 2 * 16 * 64 * 2 B = 16,384 (the clone (8, 2, 64) comes after the sum
    # is freed: 3 * 4,096 + 2,048 = 14,336)
    if (tp, b) == (2, 2):
        assert megatron_peak == 4 * 2 * 16 * 64 * 2 == 16_384
