"""ConvTapsInLanes: a one-output-channel conv over a long strided row of taps (a decimating FIR
filter, as in an audio model's CQT front end), its taps summed in vector lanes."""

import pytest
from loop_structure import loop_kinds
from tvm.relax.op import add, nn

from tvm_fusion.schedules.cpu import ConvTapsInLanes
from tvm_fusion.schedules.registry import rules_for_kind


def _fir(x, w, b=None, strides=(1, 2), padding=(0, 0)):
    y = nn.conv2d(x, w, strides=strides, padding=padding)
    return y if b is None else add(y, b)


def test_runs_before_the_direct_conv():
    names = [type(rule).__name__ for rule in rules_for_kind("llvm")]
    assert names.index("ConvTapsInLanes") < names.index("Conv2dNCHW")


@pytest.mark.parametrize("width, taps, padding", [(1000, 256, 0), (4111, 128, 0), (777, 256, 7)])
def test_a_decimating_filter_matches_the_unscheduled_kernel(assert_schedule_matches, lanes, width, taps, padding):
    """Outputs in runs of 32 across cores (the last run partial), the taps as one vector of
    partial sums; the bias added per output; an odd width and a padded row."""
    funcs = assert_schedule_matches(
        ConvTapsInLanes(), lambda x, w, b: _fir(x, w, b, padding=(0, padding)), rtol=1e-4, atol=1e-4,
        x=(1, 1, 1, width), w=(1, 1, 1, taps), b=(1, 1, 1, 1))
    (func,) = funcs.values()
    outputs = (width + 2 * padding - taps) // 2 + 1
    loops = loop_kinds(func)
    assert loops.parallel == [-(-outputs // 32)]
    assert lanes in loops.vectorized


@pytest.mark.parametrize("x, w, strides", [
    ((1, 1, 1, 1000), (2, 1, 1, 256), (1, 2)),   # two output channels: the direct conv shares its loads
    ((1, 1, 1, 1000), (1, 1, 1, 256), (1, 1)),   # stride 1: the direct conv's loads are contiguous
    ((1, 1, 1, 1000), (1, 1, 1, 40), (1, 2)),    # under four vectors of taps
    ((1, 1, 1, 1000), (1, 1, 1, 100), (1, 2)),   # taps not whole vectors
    ((1, 32, 172, 88), (1, 32, 7, 3), (1, 1)),   # a 2-D head of one channel: three taps a row
])
def test_must_not_take_other_convs(lowered, prim_funcs, target, x, w, strides):
    mod = lowered(lambda x_, w_: _fir(x_, w_, strides=strides), x=x, w=w)
    (func,) = prim_funcs(mod).values()
    assert ConvTapsInLanes().apply(func, target, False) is None
