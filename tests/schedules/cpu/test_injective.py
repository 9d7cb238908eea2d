"""Injective: fused, vectorized, parallel element-wise and data-movement functions."""

import math

import pytest
from loop_structure import loop_kinds
from tvm import relax
from tvm.relax.op import add, concat, greater, nn, permute_dims, reshape, split, take, where

from tvm_fusion.schedules.cpu import Injective

# Below this many elements a block runs on one core (the rule's launch-cost threshold).
MIN_PARALLEL_ELEMENTS = 4096


def assert_fused_vectors(funcs, lanes, elements: int, blocks: int):
    """Each of the kernel's ``blocks`` loop nests fused into one loop of ``elements``, split
    into vectors of the target's width when they divide it, the rest across cores when large."""
    (func,) = funcs.values()
    vectors = elements % lanes == 0 and elements > lanes
    loops = loop_kinds(func)
    assert loops.vectorized == ([lanes] * blocks if vectors else [])
    parallel = elements // lanes if vectors else elements
    assert loops.parallel == ([parallel] * blocks if elements >= MIN_PARALLEL_ELEMENTS else [])


@pytest.mark.parametrize("shape", [(128, 256), (3, 5, 7), (1,)])
def test_elementwise_chain(assert_schedule_matches, lanes, shape):
    funcs = assert_schedule_matches(Injective(), lambda x, y: nn.gelu(add(x, y)), x=shape, y=shape)
    # the add is inlined; gelu's erf block and its output block are kept (erf is not recomputed)
    assert_fused_vectors(funcs, lanes, math.prod(shape), blocks=2)


def test_broadcast_add(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(Injective(), add, x=(4, 33, 16), y=(16,))
    assert_fused_vectors(funcs, lanes, 4 * 33 * 16, blocks=1)


def test_reshape_transpose(assert_schedule_matches, lanes):
    def heads(x):
        return permute_dims(reshape(x, (1, 128, 4, 64)), (0, 2, 1, 3))

    funcs = assert_schedule_matches(Injective(), heads, x=(1, 128, 256))
    assert_fused_vectors(funcs, lanes, 128 * 256, blocks=1)  # the reshape inlined


def test_concat_and_where(assert_schedule_matches, lanes):
    def block(x, y):
        both = concat([x, y], axis=1)
        return where(greater(both, relax.const(0.0)), both, relax.const(0.5))

    funcs = assert_schedule_matches(Injective(), block, x=(6, 5), y=(6, 11))
    assert_fused_vectors(funcs, lanes, 6 * 16, blocks=1)  # the concat and the comparison inlined into the select


def test_a_concat_read_by_a_split_is_one_pass(assert_schedule_matches, lanes):
    """YOLOv8's head: maps of three sizes flattened, joined and split into box and class rows.
    The concats are selects inlined into each split output (no joined copy written first)."""
    def head(a, b, c):
        flat = [reshape(m, (1, 8, size)) for m, size in ((a, 64), (b, 16), (c, 4))]
        return split(concat(flat, axis=2), [4], axis=1)

    # 4 x 84 values per output: whole vectors at 8 and 16 lanes.
    funcs = assert_schedule_matches(Injective(), head, a=(1, 8, 8, 8), b=(1, 8, 4, 4), c=(1, 8, 2, 2))
    (func,) = funcs.values()
    assert "alloc_buffer" not in func.script()
    assert len(loop_kinds(func).vectorized) == 2  # the two outputs, each one loop nest


def test_a_blocked_map_runs_its_rows_across_cores(assert_schedule_matches, lanes):
    """NCHW[x]c maps (5-D, a channel block innermost): a core's share is a band of rows, as in
    the convs before and after, whatever the op does along the channels (a concat here)."""
    funcs = assert_schedule_matches(Injective(), lambda x, y: concat([x, y], axis=1),
                                    x=(1, 3, 24, 20, lanes), y=(1, 2, 24, 20, lanes))
    loops = loop_kinds(next(iter(funcs.values())))
    assert loops.parallel == [24]
    assert loops.vectorized == [lanes]


def test_take_rows(lowered, prim_funcs, target):
    mod = lowered(lambda table, x: take(table, relax.const([3, 0, 2], "int64"), axis=0),
                  table=(10, 16), x=(1,))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is not None


def test_declines_reduction(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for func in prim_funcs(mod).values():
        assert Injective().apply(func, target, False) is None
