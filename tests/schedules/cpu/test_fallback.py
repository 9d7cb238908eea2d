"""Fallback: answers for anything and keeps results correct."""

from tvm.relax.op import argmax, cumsum, matmul, nn, permute_dims, sum as reduce_sum

from tvm_fusion.schedules.cpu import Fallback


def test_transposed_matmul(assert_schedule_matches):
    def block(x, w):
        return matmul(x, permute_dims(w))

    assert_schedule_matches(Fallback(), block, rtol=1e-4, atol=1e-4, x=(8, 32), w=(16, 32))


def test_reduction_over_leading_axis(assert_schedule_matches):
    assert_schedule_matches(Fallback(), lambda x: reduce_sum(x, axis=[0]), x=(9, 31))


def test_softmax(assert_schedule_matches):
    assert_schedule_matches(Fallback(), lambda x: nn.softmax(x, axis=-1), x=(3, 7, 5))


def test_cumsum(assert_schedule_matches):
    assert_schedule_matches(Fallback(), lambda x: cumsum(x, axis=1), x=(4, 6))


def test_argmax_answers(lowered, prim_funcs, target):
    mod = lowered(lambda x: argmax(x, axis=1), x=(4, 6))
    for func in prim_funcs(mod).values():
        assert Fallback().apply(func, target, False) is not None
