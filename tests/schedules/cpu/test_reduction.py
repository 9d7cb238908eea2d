"""Reduction: row-wise softmax and norms, rows across cores."""

import pytest
from tvm.relax.op import mean, nn, sum as reduce_sum

from tvm_fusion.schedules.cpu import Reduction


@pytest.mark.parametrize("shape", [(1, 4, 32, 128), (3, 7, 5), (2, 3)])
def test_softmax_matches_unscheduled(assert_schedule_matches, shape):
    assert_schedule_matches(Reduction(), lambda x: nn.softmax(x, axis=-1), x=shape)


@pytest.mark.parametrize("rows, cols", [(128, 256), (7, 33)])
def test_layer_norm_matches_unscheduled(assert_schedule_matches, rows, cols):
    def norm(x, gamma, beta):
        return nn.layer_norm(x, gamma, beta, axes=[-1])

    assert_schedule_matches(
        Reduction(), norm, rtol=1e-4, atol=1e-4, x=(rows, cols), gamma=(cols,), beta=(cols,)
    )


def test_rms_norm_matches_unscheduled(assert_schedule_matches):
    def norm(x, gamma):
        return nn.rms_norm(x, gamma, axes=[-1])

    assert_schedule_matches(Reduction(), norm, rtol=1e-4, atol=1e-4, x=(2, 9, 48), gamma=(48,))


def test_row_sum_matches_unscheduled(assert_schedule_matches):
    assert_schedule_matches(Reduction(), lambda x: reduce_sum(x, axis=[-1]), x=(10, 37))


def test_global_mean_matches_unscheduled(assert_schedule_matches):
    """The divide block has no loop below the row: the row loop must not be vectorized."""
    assert_schedule_matches(Reduction(), lambda x: mean(x, axis=[2, 3], keepdims=True), x=(2, 64, 7, 7))


def test_declines_elementwise(lowered, prim_funcs, target):
    mod = lowered(nn.relu, x=(8, 32))
    for func in prim_funcs(mod).values():
        assert Reduction().apply(func, target, False) is None


def test_column_sum_matches_unscheduled(assert_schedule_matches):
    assert_schedule_matches(Reduction(), lambda x: reduce_sum(x, axis=[0]), x=(8, 33))


def test_declines_all_unit_rows(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(1, 1))
    for func in prim_funcs(mod).values():
        assert Reduction().apply(func, target, False) is None
