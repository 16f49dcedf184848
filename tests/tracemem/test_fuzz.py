"""Bounded fuzzing of the entry points (issue 9 item 8): whatever goes in, only
``TracememError`` leaves the Python API, and the CLI exits 0 or 2, with one line on stderr for 2.

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
