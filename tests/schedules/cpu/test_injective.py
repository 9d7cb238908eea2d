"""Injective: fused, vectorized, parallel element-wise and data-movement functions."""

import pytest
from tvm import relax
from tvm.relax.op import add, concat, nn, permute_dims, reshape, take, where, greater

from tvm_fusion.schedules.cpu import Injective


@pytest.mark.parametrize("shape", [(128, 256), (3, 5, 7), (1,)])
def test_elementwise_chain(assert_schedule_matches, shape):
    assert_schedule_matches(Injective(), lambda x, y: nn.gelu(add(x, y)), x=shape, y=shape)


def test_broadcast_add(assert_schedule_matches):
    assert_schedule_matches(Injective(), add, x=(4, 33, 16), y=(16,))


def test_reshape_transpose(assert_schedule_matches):
    def heads(x):
        return permute_dims(reshape(x, (1, 128, 4, 64)), (0, 2, 1, 3))

    assert_schedule_matches(Injective(), heads, x=(1, 128, 256))


def test_concat_and_where(assert_schedule_matches):
    def block(x, y):
        both = concat([x, y], axis=1)
        return where(greater(both, relax.const(0.0)), both, relax.const(0.5))

    assert_schedule_matches(Injective(), block, x=(6, 5), y=(6, 11))


def test_take_rows(lowered, prim_funcs, target):
    mod = lowered(lambda table, x: take(table, relax.const([3, 0, 2], "int64"), axis=0),
                  table=(10, 16), x=(1,))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is not None


def test_declines_reduction(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is None
