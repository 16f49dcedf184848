"""torchtitan's published measured runs (tracemem.validation.torchtitan_runs): the source's
facts as the board states them, and the scoring arithmetic on a stand-in estimate.

Reference: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Table 1: Llama 3.1
8B, 8 GPUs, local batch 2, FSDP 82.4 GiB; Table 3: 128 GPUs, 67.0 GiB; torchtitan 9dec370
train_configs/llama3_8b.toml: seq_len 8192, selective AC "op"; torchtitan/metrics.py:
max_reserved_gib = reserved_bytes.all.peak / 2^30).
"""

from types import SimpleNamespace

from tracemem.cli import main
from tracemem.validation import torchtitan_runs as board


def test_the_runs_are_the_sources_rows():
    assert [(r.world_size, r.memory_gib, r.micro_batch_size, r.seq_length)
            for r in board.RUNS] == [(8, 82.4, 2, 8192), (128, 67.0, 2, 8192)]


def test_a_run_is_the_2024_job():
    job = board.run_job(board.RUNS[0])
    assert (job.parallel.world_size, job.parallel.dp, job.parallel.zero) == (8, 8, 3)
    assert (job.micro_batch_size, job.seq_length, job.microbatches) == (2, 8192, 1)
    assert job.parallel.precision == "fsdp2" and job.profile.name == "torch"
    assert job.profile.fused_qkv is False  # 9dec370's Attention: wq, wk, wv
    assert job.profile.zero_grad_set_to_none is True  # 9dec370: optimizers.zero_grad()
    assert job.recompute == "selective" and tuple(job.recompute_modules) == ("op",)
    # freqs_cis of max_seq_len * 2 rows (9dec370 models/llama/model.py), Llama 3.1 8B's shapes
    cfg = job.config
    assert cfg.max_position_embeddings == 16_384
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14_336, 128_256)
    assert job.hbm_bytes == 96 * 10**9


def test_the_error_is_reserved_against_measured():
    # a stand-in estimate whose worst rank reserves exactly 80 GiB: (80 - 82.4) / 82.4
    rank = SimpleNamespace(reserved_peak_bytes=80 * 2**30, allocated_peak_bytes=70 * 2**30,
                           peak_step="0B0")
    scores = board.score(board.RUNS[:1], estimate=lambda job: SimpleNamespace(ranks=[rank]))
    assert round(scores[0].error_pct, 4) == round(100 * (80 - 82.4) / 82.4, 4) == -2.9126
    text = board.format_scores(scores)
    assert "Table 1 (8B, 8 GPUs), FSDP" in text and "-2.9%" in text
    assert "torch.compile is refused" in text and "RoPE table" in text


def test_cli_refuses_a_case(capsys):
    assert main(["validate", "--against", "torchtitan-runs", "--case", "mlp"]) == 2
    assert "--against torchtitan-runs" in capsys.readouterr().err
