"""Pooling: window loops outside a vector tile of output columns; global pools per channel."""

import pytest
from tvm import relax
from tvm.relax.op import nn

from tvm_fusion.schedules.cpu import Pooling


@pytest.mark.parametrize("pool", [
    lambda x: nn.max_pool2d(x, 3, 2, 1),
    lambda x: nn.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
    lambda x: nn.max_pool2d(x, 2, 2, 0, ceil_mode=True),
    lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True),
])
def test_pool_matches_unscheduled(assert_schedule_matches, pool):
    assert_schedule_matches(Pooling(), pool, rtol=1e-5, atol=1e-5, x=(1, 16, 15, 17))


def test_global_pool_in_vector_partial_sums_matches_unscheduled(assert_schedule_matches):
    # 16 x 16 positions: whole vectors of partial sums per channel
    assert_schedule_matches(Pooling(), lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True),
                            rtol=1e-5, atol=1e-5, x=(2, 24, 16, 16))


def test_1d_and_3d_pools_match_unscheduled(assert_schedule_matches):
    assert_schedule_matches(Pooling(), lambda x: nn.avg_pool1d(x, 3, 1, 1), rtol=1e-5, atol=1e-5, x=(2, 4, 20))
    assert_schedule_matches(Pooling(), lambda x: nn.max_pool3d(x, 2, 1, 0), rtol=1e-5, atol=1e-5, x=(1, 3, 6, 7, 8))


def test_declines_conv(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: nn.conv2d(x, w), x=(1, 4, 8, 8), w=(4, 4, 1, 1))
    for func in prim_funcs(mod).values():
        assert Pooling().apply(func, target, False) is None
