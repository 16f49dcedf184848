"""Issue 26, hardening: each reproducer of the fuzz run, now a one-line error (exit code 2 from
the CLI, ``TracememError`` from the API) in bounded time.

References: the issue's reproducers; int64 storage sizes (torch computes numel x element size
in int64: a tensor of 2^63 bytes or more is a RuntimeError, "Storage size calculation
overflowed"); the bounds in ``tracemem.job`` (1 PiB per tensor, 2^32 tokens, 2^12
microbatches, 2^20 GPUs, 4,096 virtual stages), ``tracemem.examples`` (256 toy layers) and
``modeling.registry`` (2^16 expert modules); Python's own behaviour for a closed pipe and a
full device.
"""

from __future__ import annotations

import errno
import io
import json
import sys
import threading
import time

import pytest

from tracemem.cli import main
from tracemem.errors import TracememError

TINY = dict(world_size=1, micro_batch_size=1, seq_length=16, num_microbatches=1,
            kernels="eager")
EST = ["estimate", "--model", "deepseek-tiny", "--world-size", "1", "--micro-batch-size", "1",
       "--seq-length", "16", "--num-microbatches", "1", "--kernels", "eager", "--quiet"]
BIG = "9223372036854775808"  # 2^63


def _one_line_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize("argv, message", [
    (["crosscheck", "--korthikanti", "--s", BIG],
     f"--b 1 x --s {BIG} = 9,223,372,036,854,775,808 tokens per microbatch is more than 2^32"),
    (["crosscheck", "--korthikanti", "--b", "9223372036854775807"],
     "tokens per microbatch is more than 2^32"),
    (["crosscheck", "--paper", "2502.07846", "--b", "9223372036854775807"],
     "tokens per microbatch is more than 2^32"),
    # s 2^21: the tokens pass (2^21 <= 2^32), DeepSeek-V3's 128 heads' scores do not:
    # 2^7 x 2^21 x 2^21 x 4 B = 2^51 B > 2^50 B
    (["crosscheck", "--paper", "2502.07846", "--s", str(2**21)],
     "the eager attention scores, b 1 x 128 heads x s 2097152 x s 2097152 x 4 B = "
     "2,251,799,813,685,248 B in one tensor is more than 1 PiB"),
    (["static", "--model", "deepseek-tiny", "--world-size", "1", "--vpp", "2147483648",
      "--pp-layout", "4"],
     "--pp 1 x --vpp 2147483648 = 2,147,483,648 virtual stages is more than 4,096"),
    (EST + ["--rounding", BIG], f"--rounding {BIG} is more than 2^30 (1 GiB)"),
    (["toy", "--seq-length", "2147483648"],
     "the attention scores, b 1 x 16 heads x s 2147483648 x s 2147483648 x 4 B"),
    (["toy", "--hidden-size", "2147483648"], "--hidden-size 2147483648 is more than 16,777,216"),
    (["toy", "--vocab-size", "1" + "0" * 30], "--vocab-size 1" + "0" * 30 + " is more than"),
    (["toy", "--micro-batch-size", "9223372036854775807"],
     "--micro-batch-size 9223372036854775807 x --seq-length 1024"),
    (["toy", "--num-layers", "2147483648"], "--num-layers 2147483648 is more than 256"),
    (EST[:3] + ["--world-size", str(2**40)] + EST[5:],
     f"--world-size {2**40} is more than 2^20 GPUs"),
    (EST + ["--seq-length", str(2**31), "--attention", "eager"],
     "--attention eager keeps the s x s scores: b 1 x 4 heads x s 2147483648"),
])
def test_huge_values_are_one_line_errors(capsys, argv, message):
    _one_line_error(capsys, argv, message)


@pytest.mark.parametrize("key, experts", [("num_experts", 2**24), ("num_local_experts", 2**24)])
def test_params_on_millions_of_experts_is_refused_before_building(tmp_path, capsys, key,
                                                                  experts):
    # qwen3-moe-tiny: 4 layers, layer 0 dense -> 3 MoE layers; mixtral-tiny: 4 MoE layers
    preset = "qwen3_moe/presets/qwen3-moe-tiny" if key == "num_experts" else \
        "mixtral/presets/mixtral-tiny"
    from pathlib import Path

    import modeling

    data = json.loads((Path(modeling.__file__).parent / "families" / f"{preset}.json")
                      .read_text())
    data[key] = experts
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    layers = 3 if key == "num_experts" else 4
    started = time.monotonic()
    _one_line_error(capsys, ["params", "--model", str(path)],
                    f"16,777,216 routed experts x {layers} MoE layers = "
                    f"{experts * layers:,} expert modules is more than 65,536")
    assert time.monotonic() - started < 5  # refused, not built (it hung before)


@pytest.mark.parametrize("fields, message", [
    (dict(recompute="selective", recompute_modules=None),
     r"--recompute-modules None is invalid; give module names"),
    (dict(recompute_modules=None), r"--recompute-modules None is invalid"),
    (dict(kernels=["torch"]), r"--kernels \['torch'\] is invalid; give a profile name"),
    (dict(kernel_options="x"), r"kernel_options 'x' is invalid; give a dict"),
    (dict(alloc_conf=3), r"--alloc-conf 3 is invalid; give a string"),
    (dict(gpu=["H100"]), r"--gpu \['H100'\] is invalid; give a string"),
    (dict(pp_layout=3), r"--pp-layout 3 is invalid; give one integer per virtual"),
    (dict(replace=3), r"--replace 3 is invalid"),
    (dict(megatron_args=3), r"megatron_args 3 is invalid; give a tuple of strings"),
    (dict(deallocate_pipeline_outputs="x"), r"deallocate_pipeline_outputs 'x' is invalid"),
    (dict(make_vocab_size_divisible_by=2**80), r"is more than 2\^24"),
    (dict(rounding=2**63), r"--rounding 9223372036854775808 is more than 2\^30"),
    (dict(num_microbatches=2**13), r"--num-microbatches 8192 is more than 2\^12 \(4,096\): "
                                   r"the replay simulates every allocation"),
])
def test_api_types_and_sizes_are_one_line_errors(fields, message):
    import tracemem

    with pytest.raises(TracememError, match=message) as info:
        tracemem.estimate("deepseek-tiny", **(TINY | fields))
    assert "\n" not in str(info.value)


def test_one_recompute_module_may_be_a_string():
    from tracemem.job import Job

    job = Job(model="deepseek-tiny", recompute="selective", recompute_modules="core_attn",
              **TINY)
    assert job.recompute_modules == ("core_attn",)


@pytest.mark.parametrize("content, message", [
    ("[" + "9" * 400 + ", 0.5]", "the file holds a count above 2^63"),
    ("[" + ", ".join(["9" * 4000] * 8) + "]", "the file holds a count above 2^63"),
    ('{"' + "9" * 5000 + '": [1]}', 'key "' + "9" * 37 + '..." is not a layer number'),
])
def test_routing_counts_files_with_huge_integers_are_one_line_errors(tmp_path, content,
                                                                      message):
    from modeling.common.routing import parse_routing

    path = tmp_path / "counts.json"
    path.write_text(content)
    with pytest.raises(TracememError) as info:
        parse_routing(f"counts:{path}")
    assert message in str(info.value) and "\n" not in str(info.value)


class _Failing(io.StringIO):
    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text):
        raise self.error


@pytest.mark.parametrize("error, code, err", [
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), 0, ""),  # `| head`: the reader left
    (OSError(errno.ENOSPC, "No space left on device"), 1,
     "tracemem: error: cannot write the output: No space left on device\n"),  # > /dev/full
])
def test_output_stream_errors_are_quiet_or_one_line(monkeypatch, capsys, error, code, err):
    monkeypatch.setattr(sys, "stdout", _Failing(error))
    assert main(["params", "--model", "deepseek-tiny"]) == code
    assert capsys.readouterr().err == err


class _FakeRay:
    """``ray`` with an ``init`` that never connects (Ray's GCS client retrying)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def init(self, **kwargs):
        self.release.wait(30)


def test_ray_address_where_nothing_listens_fails_at_once():
    import socket

    from tracemem.fit import _ray_init

    with socket.socket() as probe:  # a port with nothing listening: bound, never listened
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TracememError, match=rf"--engine ray --address 127.0.0.1:{port}: "
                                                r"nothing answers there"):
            _ray_init(_FakeRay(), f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5


_RAY_WAITS = """
import signal, sys, time
import tracemem.fit as fit

class FakeRay:  # Ray's C++ client retrying: a wait that Python's handlers do not end
    def init(self, **kwargs):
        time.sleep(20)

signal.signal(signal.SIGTERM, lambda *a: None)  # a handler that waits, as Ray's sys.exit does
fit.RAY_INIT_TIMEOUT_S = float(sys.argv[1])
fit.EXIT_ON_RAY_TIMEOUT = True
print("waiting", flush=True)
fit._ray_init(FakeRay(), "auto")
"""


@pytest.mark.parametrize("timeout_s, terminate, code, line", [
    (0.5, False, 2, "tracemem: error: --engine ray --address auto: Ray did not start or "
                    "connect in 0.5 s; check that a Ray cluster's GCS listens there (ray "
                    "status)"),
    (30, True, 143, "tracemem: stopped by SIGTERM while --engine ray --address auto "
                    "connected"),
])
def test_a_waiting_ray_init_times_out_or_stops_on_sigterm(timeout_s, terminate, code, line):
    import subprocess

    process = subprocess.Popen([sys.executable, "-c", _RAY_WAITS, str(timeout_s)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "waiting\n"
    started = time.monotonic()
    if terminate:
        time.sleep(0.2)
        process.terminate()
    _, err = process.communicate(timeout=15)
    assert (process.returncode, err.strip()) == (code, line)
    assert time.monotonic() - started < 5  # not the 20 s the fake Ray would wait


# --- from the fresh-user trial of this stop --------------------------------------------------
def test_a_negative_megatron_size_is_named():
    from tracemem.frontdoors import megatron_job_kwargs
    argv = ("--num-layers -3 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--max-position-embeddings 64 --micro-batch-size 1 --bf16 --vocab-size 100 "
            "--tokenizer-type NullTokenizer").split()
    with pytest.raises(TracememError, match=r"^--num-layers -3 must be a positive integer$"):
        megatron_job_kwargs(argv, world_size=1)


def test_hbm_takes_a_byte_count_and_a_job_names_its_missing_keywords():
    from tracemem import estimate
    from tracemem.job import parse_bytes
    assert parse_bytes(80 * 10**9) == 80 * 10**9  # as the CLI's "80000000000" and the JSON
    with pytest.raises(TracememError, match=r"^a Job needs world_size, micro_batch_size, "
                                            r"seq_length \(keywords\) beside the model "
                                            r"\(model is None\)$"):
        estimate(None)


def test_gpu_is_case_insensitive_and_one_stage_reads_as_one(capsys):
    from tracemem.cli import main
    code = main(["estimate", "--model", "llama-tiny", "--world-size", "1", "--quiet",
                 "--micro-batch-size", "1", "--seq-length", "32", "--num-microbatches", "1",
                 "--gpu", "h100", "--hbm", "80GB"])
    out = capsys.readouterr().out
    assert code == 0 and "Verdict: the pipeline stage fits in" in out


def test_from_the_second_trial_gpu_case_a_dict_model_and_left_out_by_name(capsys):
    from tracemem import estimate
    from tracemem.cli import main
    from tracemem.job import Job
    job = Job(model="llama-tiny", world_size=1, micro_batch_size=1, seq_length=32,
              num_microbatches=1, gpu="h100")
    assert job.gpu == "H100"  # as the CLI takes it
    with pytest.raises(TracememError, match=r"^the model is a dict: give a preset name"):
        estimate({"world_size": 1})
    assert main(["validate", "--against", "megatron-ci", "--left-out", "--ci-case",
                 "no-such-case"]) == 2
    assert "names no case left out" in capsys.readouterr().err
