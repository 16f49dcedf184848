"""Bounded fuzzing of the entry points (issue 9 item 8; issue 26: every ``Job`` keyword, and
huge integers on every size flag): whatever goes in, only ``TracememError`` leaves the Python
API, and the CLI exits 0 or 2, with one line on stderr for 2.

Reference: the contract itself (README: "Usage errors print one line on stderr and exit with
code 2"); hypothesis draws the inputs, from edge values to junk.
"""

import contextlib
import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeling.common.routing import parse_routing
from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.estimator import estimate, parse_bytes

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
SMALL = st.one_of(st.integers(-3, 9), JUNK)
FUZZ = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _only_tracemem_errors(call):
    try:
        call()
    except TracememError:
        pass


@FUZZ
@given(JUNK)
def test_parsers_raise_only_tracemem_errors(value):
    _only_tracemem_errors(lambda: parse_bytes(value))
    _only_tracemem_errors(lambda: parse_routing(value, 0))


@FUZZ
@given(world=SMALL, tp=SMALL, pp=SMALL, b=SMALL, s=SMALL, m=SMALL,
       hbm=st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["1GiB", "inf", "0.1B"])))
def test_estimate_raises_only_tracemem_errors(world, tp, pp, b, s, m, hbm):
    _only_tracemem_errors(lambda: estimate(
        "deepseek-tiny", world_size=world, tp=tp, pp=pp, micro_batch_size=b, seq_length=s,
        num_microbatches=m, hbm=hbm, kernels="eager"))


@FUZZ
@given(flags=st.lists(st.tuples(
    st.sampled_from(["--world-size", "--tp", "--ep", "--pp", "--seq-length", "--hbm",
                     "--routing", "--rounding", "--num-microbatches", "--units"]),
    st.one_of(st.text(max_size=8), st.integers(-5, 70).map(str))), max_size=4))
def test_cli_exits_0_or_2_with_one_line(flags):
    argv = ["estimate", "--model", "deepseek-tiny", "--world-size", "1",
            "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "1",
            "--quiet", "--kernels", "eager"]
    for flag, value in flags:
        argv += [flag, value] if not value.startswith("-") else [f"{flag}={value}"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
    assert code in (0, 2)
    if code == 2:
        assert err.getvalue().count("\n") == 1, err.getvalue()


# issue 26: every Job keyword with junk, and the huge-integer class on every size flag

HUGE = st.integers(2**33, 2**80)  # past every bound (2^32 tokens, 2^24 sizes, 2^20 GPUs)
ANY = st.one_of(JUNK, HUGE, st.lists(st.one_of(st.text(max_size=5), st.integers(-2, 4)),
                                     max_size=2),
                st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(
                    max_size=3)), max_size=2))
KEYWORD = settings(FUZZ, max_examples=80)


@KEYWORD
@given(data=st.data())
def test_every_job_keyword_raises_only_tracemem_errors(data):
    """A ``Job`` (what ``tracemem.estimate`` validates first) with one keyword set to junk:
    a TracememError or a valid job, never a TypeError or an overflow. Only the validation runs
    (no trace), so each example takes milliseconds."""
    from tracemem.job import Job, job_fields

    name = data.draw(st.sampled_from([n for n in job_fields() if n != "model"]))
    value = data.draw(ANY)
    fields = dict(world_size=1, micro_batch_size=1, seq_length=16, num_microbatches=1,
                  kernels="eager") | {name: value}
    _only_tracemem_errors(lambda: Job(model="deepseek-tiny", **fields))


@FUZZ
@given(flag=st.sampled_from([
    ("toy", "--num-layers"), ("toy", "--hidden-size"), ("toy", "--seq-length"),
    ("toy", "--micro-batch-size"), ("toy", "--vocab-size"), ("toy", "--num-attention-heads"),
    ("toy", "--rounding"), ("crosscheck --korthikanti", "--b"),
    ("crosscheck --korthikanti", "--s"), ("crosscheck --paper 2502.07846", "--b"),
    ("estimate", "--world-size"), ("estimate", "--seq-length"),
    ("estimate", "--micro-batch-size"), ("estimate", "--num-microbatches"),
    ("estimate", "--rounding"), ("estimate", "--vpp"), ("estimate", "--pp"),
    ("estimate", "--global-batch-size"), ("static", "--vpp"), ("static", "--world-size")]),
    value=HUGE)
def test_huge_integers_on_size_flags_are_one_line_errors(flag, value):
    """2^33 to 2^80 on any size flag: exit 2 with one line, before anything is built (the
    issue's tracebacks and hangs)."""
    command, name = flag
    argv = command.split()
    if command == "estimate":
        argv += ["--model", "deepseek-tiny", "--world-size", "1", "--micro-batch-size", "1",
                 "--seq-length", "16", "--num-microbatches", "1", "--quiet", "--kernels",
                 "eager"]
    elif command == "static":
        argv += ["--model", "deepseek-tiny", "--world-size", "1"]
    argv += [name, str(value)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    assert code == 2 and err.getvalue().count("\n") == 1, err.getvalue()
