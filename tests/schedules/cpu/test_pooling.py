"""Pooling: window loops outside a vector tile of output columns; global pools per channel."""

import pytest
from loop_structure import largest_divisor, loop_kinds, whole_vectors
from tvm import relax
from tvm.relax.op import nn

from tvm_fusion.schedules.cpu import Pooling


def assert_window_tiles(func, lanes, rows: int, columns: int, window: tuple[int, ...]):
    """Output rows across cores (the last parallel loop; a pad pass may come first), up to 4
    vectors of output columns per tile (a divisor of the row when vectors do not divide it),
    each window loop unrolled."""
    cols = whole_vectors(columns, lanes, 4) or largest_divisor(columns, lanes)
    loops = loop_kinds(func)
    assert loops.parallel[-1] == rows
    assert loops.vectorized == [cols] * len(loops.vectorized) and len(loops.vectorized) >= 2
    assert all(loops.unrolled.count(taps) >= window.count(taps) for taps in window)


@pytest.mark.parametrize("pool, rows, columns, window", [
    (lambda x: nn.max_pool2d(x, 3, 2, 1), 16 * 8, 9, (3, 3)),
    (lambda x: nn.avg_pool2d(x, 3, 1, 1, count_include_pad=False), 16 * 15, 17, (3, 3)),
    (lambda x: nn.max_pool2d(x, 2, 2, 0, ceil_mode=True), 16 * 8, 9, (2, 2)),
])
def test_pool_matches_unscheduled(assert_schedule_matches, lanes, pool, rows, columns, window):
    funcs = assert_schedule_matches(Pooling(), pool, rtol=1e-5, atol=1e-5, x=(1, 16, 15, 17))
    (func,) = funcs.values()
    assert_window_tiles(func, lanes, rows, columns, window)


@pytest.mark.parametrize("size", [(15, 17), (16, 16)])
def test_global_pool_matches_unscheduled(assert_schedule_matches, lanes, size):
    """Channels across cores; each channel's map summed in vector partial sums when whole
    vectors divide it (16 x 16), as a scalar sum otherwise (15 x 17)."""
    funcs = assert_schedule_matches(Pooling(), lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True),
                                    rtol=1e-5, atol=1e-5, x=(2, 24, *size))
    (func,) = funcs.values()
    loops = loop_kinds(func)
    assert loops.parallel == [2 * 24]
    split = size[0] * size[1] % lanes == 0
    assert loops.vectorized == ([lanes, lanes] if split else [])


def test_1d_and_3d_pools_match_unscheduled(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(Pooling(), lambda x: nn.avg_pool1d(x, 3, 1, 1), rtol=1e-5, atol=1e-5,
                                    x=(2, 4, 20))
    assert_window_tiles(*funcs.values(), lanes, rows=2 * 4, columns=20, window=(3,))
    funcs = assert_schedule_matches(Pooling(), lambda x: nn.max_pool3d(x, 2, 1, 0), rtol=1e-5, atol=1e-5,
                                    x=(1, 3, 6, 7, 8))
    assert_window_tiles(*funcs.values(), lanes, rows=3 * 5 * 6, columns=7, window=(2, 2, 2))


def test_declines_conv(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: nn.conv2d(x, w), x=(1, 4, 8, 8), w=(4, 4, 1, 1))
    for func in prim_funcs(mod).values():
        assert Pooling().apply(func, target, False) is None


@pytest.mark.parametrize("layout, shape, padded_pass", [
    ("NCHW16c", (1, 4, 15, 17, 16), False),  # the vector is the channel block: pad read in the window
    ("NCHW", (1, 16, 15, 17), True),         # the vector runs along the padded columns: a pass first
])
def test_a_pad_beside_the_vector_axis_is_read_in_the_window(assert_schedule_matches, layout, shape, padded_pass):
    """In NCHW[x]c the pad's select depends on the row and column only, one condition per
    vector: it is inlined into the window's loads, and no pass writes a padded map."""
    funcs = assert_schedule_matches(Pooling(), lambda x: nn.max_pool2d(x, 3, 2, (0, 0, 1, 1), layout=layout),
                                    rtol=0, atol=0, x=shape)
    (func,) = funcs.values()
    assert len(loop_kinds(func).parallel) == (2 if padded_pass else 1)
    assert ("pad" in func.script()) == padded_pass
