"""Reduction: row-wise softmax and norms, rows across cores, a norm's sums as vectors of partial
sums."""

import math

import pytest
from loop_structure import loop_kinds, root_loop_nests
from tvm.relax.op import mean, nn, sum as reduce_sum

from tvm_fusion.schedules.cpu import Reduction


def assert_rows(funcs, rows: int, vectorized: list[int]):
    """One kernel, its rows in one parallel loop (a single row: a serial one), and exactly these
    vectorized loops."""
    (func,) = funcs.values()
    loops = loop_kinds(func)
    assert loops.parallel == ([rows] if rows > 1 else [])
    assert sorted(loops.vectorized) == sorted(vectorized)


def partial_sums(width: int, lanes: int, reductions: int) -> list[int]:
    """The vectorized loops of a row's reductions: each one over a row of whole vectors (more
    than one) runs as a vector of partial sums, its update and its init one vector loop each."""
    return [lanes] * 2 * reductions if width > lanes and width % lanes == 0 else []


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
    # the normalized row; the mean and the variance
    assert_rows(funcs, rows, [row_vector(cols, lanes)] + partial_sums(cols, lanes, 2))


def test_a_norm_over_two_axes_sums_them_as_one_row_of_partial_sums(assert_schedule_matches, lanes):
    """A LayerNorm over [H, W] (a GroupNorm's spelling): its two reduction axes fused into one
    row of whole vectors, summed as partial sums."""
    def norm(x, gamma, beta):
        return nn.layer_norm(x, gamma, beta, axes=[-2, -1])

    funcs = assert_schedule_matches(Reduction(), norm, rtol=1e-4, atol=1e-4, x=(4, 3, 2 * lanes),
                                    gamma=(3, 2 * lanes), beta=(3, 2 * lanes))
    assert_rows(funcs, 4, [lanes] + partial_sums(3 * 2 * lanes, lanes, 2))


def test_rms_norm_matches_unscheduled(assert_schedule_matches, lanes):
    def norm(x, gamma):
        return nn.rms_norm(x, gamma, axes=[-1])

    funcs = assert_schedule_matches(Reduction(), norm, rtol=1e-4, atol=1e-4, x=(2, 9, 48), gamma=(48,))
    assert_rows(funcs, 2 * 9, [row_vector(48, lanes)] + partial_sums(48, lanes, 1))


def test_row_sum_matches_unscheduled(assert_schedule_matches):
    funcs = assert_schedule_matches(Reduction(), lambda x: reduce_sum(x, axis=[-1]), x=(10, 37))
    assert_rows(funcs, 10, [])


def test_global_mean_matches_unscheduled(assert_schedule_matches):
    """The divide block has no loop below the row: the row loop must not be vectorized."""
    funcs = assert_schedule_matches(Reduction(), lambda x: mean(x, axis=[2, 3], keepdims=True), x=(2, 64, 7, 7))
    assert_rows(funcs, 2 * 64, [])


def test_must_not_split_a_plain_reduction_into_lanes(assert_schedule_matches, lanes):
    """A graph's own sums (a decomposed variance) stay in ONNX Runtime's order, even over whole
    vectors: summed in lanes, an ill-conditioned one moves off ONNX Runtime's result."""
    funcs = assert_schedule_matches(Reduction(), lambda x: mean(x, axis=[-1]), x=(8, 4 * lanes))
    assert_rows(funcs, 8, [])


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


def _layer_norm(x, gamma, beta):
    return nn.layer_norm(x, gamma, beta, axes=[-1])


def _rms_norm(x, gamma):
    return nn.rms_norm(x, gamma, axes=[-1])


def _softmax(x):
    return nn.softmax(x, axis=-1)


def _row_mean(x):
    return mean(x, axis=[-1], keepdims=True)


def _row_sum(x):
    return reduce_sum(x, axis=[-1])


@pytest.mark.parametrize("fn, shapes, elementwise, reductions", [
    (_layer_norm, {"x": (1, 512), "gamma": (512,), "beta": (512,)}, 1, 2),    # magika-v3's last norm
    (_layer_norm, {"x": (1, 1, 256), "gamma": (256,), "beta": (256,)}, 1, 2),  # one token of a decoder
    (_layer_norm, {"x": (1, 33), "gamma": (33,), "beta": (33,)}, 1, 2),       # no whole vectors
    (_rms_norm, {"x": (1, 48), "gamma": (48,)}, 1, 1),
    (_softmax, {"x": (1, 100)}, 2, 0),
    (_softmax, {"x": (1, 1, 64)}, 2, 0),
    (_row_mean, {"x": (1, 64)}, 0, 0),
    (_row_sum, {"x": (1, 37)}, 0, 0),
])
def test_a_single_row_is_one_serial_task(assert_schedule_matches, lanes, fn, shapes, elementwise, reductions):
    """normalize_prim_func drops the unit row from the element-wise blocks (S(512)) but gives
    the sums one back (S(1) R(512)); the rule still takes the kernel as one row (it was left to
    Fallback): every block in one serial loop nest, its ``elementwise`` loops over the row on
    vectors, a norm's ``reductions`` as vectors of partial sums where the row is whole vectors,
    and the unscheduled kernel's numbers."""
    funcs = assert_schedule_matches(Reduction(), fn, rtol=1e-4, atol=1e-4, **shapes)
    (func,) = funcs.values()
    assert root_loop_nests(func) == 1
    width = shapes["x"][-1]
    assert_rows(funcs, 1, [row_vector(width, lanes)] * elementwise + partial_sums(width, lanes, reductions))
