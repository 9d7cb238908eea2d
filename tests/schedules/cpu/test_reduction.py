"""Reduction: row-wise softmax and norms, rows across cores."""

import math

import pytest
from loop_structure import loop_kinds
from tvm.relax.op import mean, nn, sum as reduce_sum

from tvm_fusion.schedules.cpu import Reduction


def assert_rows(funcs, rows: int, vectorized: list[int]):
    """One kernel, its rows in one parallel loop, and exactly these vectorized loops."""
    (func,) = funcs.values()
    loops = loop_kinds(func)
    assert loops.parallel == [rows]
    assert loops.vectorized == vectorized


def row_vector(width: int, lanes: int) -> int:
    """An element-wise loop over a row runs in vectors of the target's width when they divide
    it, else as one vector of the whole row."""
    return lanes if width > lanes and width % lanes == 0 else width


@pytest.mark.parametrize("shape", [(1, 4, 32, 128), (3, 7, 5), (2, 3)])
def test_softmax_matches_unscheduled(assert_schedule_matches, lanes, shape):
    funcs = assert_schedule_matches(Reduction(), lambda x: nn.softmax(x, axis=-1), x=shape)
    # exp and normalize on vectors; the row max and sum stay scalar reductions
    assert_rows(funcs, math.prod(shape[:-1]), [row_vector(shape[-1], lanes)] * 2)


@pytest.mark.parametrize("rows, cols", [(128, 256), (7, 33)])
def test_layer_norm_matches_unscheduled(assert_schedule_matches, lanes, rows, cols):
    def norm(x, gamma, beta):
        return nn.layer_norm(x, gamma, beta, axes=[-1])

    funcs = assert_schedule_matches(
        Reduction(), norm, rtol=1e-4, atol=1e-4, x=(rows, cols), gamma=(cols,), beta=(cols,)
    )
    assert_rows(funcs, rows, [row_vector(cols, lanes)])  # the normalized row


def test_rms_norm_matches_unscheduled(assert_schedule_matches, lanes):
    def norm(x, gamma):
        return nn.rms_norm(x, gamma, axes=[-1])

    funcs = assert_schedule_matches(Reduction(), norm, rtol=1e-4, atol=1e-4, x=(2, 9, 48), gamma=(48,))
    assert_rows(funcs, 2 * 9, [row_vector(48, lanes)])


def test_row_sum_matches_unscheduled(assert_schedule_matches):
    funcs = assert_schedule_matches(Reduction(), lambda x: reduce_sum(x, axis=[-1]), x=(10, 37))
    assert_rows(funcs, 10, [])


def test_global_mean_matches_unscheduled(assert_schedule_matches):
    """The divide block has no loop below the row: the row loop must not be vectorized."""
    funcs = assert_schedule_matches(Reduction(), lambda x: mean(x, axis=[2, 3], keepdims=True), x=(2, 64, 7, 7))
    assert_rows(funcs, 2 * 64, [])


def test_declines_elementwise(lowered, prim_funcs, target):
    mod = lowered(nn.relu, x=(8, 32))
    for func in prim_funcs(mod).values():
        assert Reduction().apply(func, target, False) is None


def test_column_sum_matches_unscheduled(assert_schedule_matches):
    funcs = assert_schedule_matches(Reduction(), lambda x: reduce_sum(x, axis=[0]), x=(8, 33))
    assert_rows(funcs, 33, [])  # the output columns are the rows; each sums down its column


def test_declines_all_unit_rows(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(1, 1))
    for func in prim_funcs(mod).values():
        assert Reduction().apply(func, target, False) is None
