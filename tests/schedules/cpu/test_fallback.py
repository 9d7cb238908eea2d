"""Fallback: answers for anything and keeps results correct, running only the leading
data-parallel loops of each block across cores (no vectors, no unrolling)."""

import numpy as np
import tvm
from loop_structure import loop_kinds
from tvm.relax.op import argmax, matmul, nn, permute_dims, sum as reduce_sum
from tvm.script import tirx as T

from tvm_fusion.schedules.cpu import Fallback


def parallel_only(funcs) -> dict[str, list[int]]:
    """Each kernel's parallel loop extents, after checking nothing else was annotated."""
    for func in funcs.values():
        loops = loop_kinds(func)
        assert loops.vectorized == [] and loops.unrolled == []
    return {name: loop_kinds(func).parallel for name, func in funcs.items()}


def test_transposed_matmul(assert_schedule_matches):
    def block(x, w):
        return matmul(x, permute_dims(w))

    funcs = assert_schedule_matches(Fallback(), block, rtol=1e-4, atol=1e-4, x=(8, 32), w=(16, 32))
    assert parallel_only(funcs) == {"transpose": [16 * 32], "matmul": [8 * 16]}  # not the k loop


def test_reduction_over_leading_axis(assert_schedule_matches):
    funcs = assert_schedule_matches(Fallback(), lambda x: reduce_sum(x, axis=[0]), x=(9, 31))
    assert parallel_only(funcs) == {"sum": [31]}


def test_softmax(assert_schedule_matches):
    funcs = assert_schedule_matches(Fallback(), lambda x: nn.softmax(x, axis=-1), x=(3, 7, 5))
    # row max, exp, row sum, normalize: the reductions over rows only, the element-wise blocks whole
    assert parallel_only(funcs) == {"softmax": [3 * 7, 3 * 7 * 5, 3 * 7, 3 * 7 * 5]}


@T.prim_func(s_tir=True)
def prefix_sum(x: T.Buffer((4, 6), "float32"), y: T.Buffer((4, 6), "float32")):
    for i, j in T.grid(4, 6):
        with T.sblock("scan"):
            vi = T.axis.spatial(4, i)
            vj = T.axis.opaque(6, j)
            y[vi, vj] = T.if_then_else(vj == 0, x[vi, vj], y[vi, vj - 1] + x[vi, vj])


def test_scan_with_an_opaque_axis_is_left_serial(target):
    """``parallel`` refuses a block with an opaque axis; the rule must still answer."""
    sch = Fallback().apply(prefix_sum, target, False)
    assert sch is not None
    assert loop_kinds(sch.mod["main"]).parallel == []
    x = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")
    y = tvm.runtime.tensor(np.zeros((4, 6), "float32"))
    tvm.compile(sch.mod, target=target)["main"](tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)


def test_argmax_answers(lowered, prim_funcs, target):
    mod = lowered(lambda x: argmax(x, axis=1), x=(4, 6))
    for func in prim_funcs(mod).values():
        sch = Fallback().apply(func, target, False)
        assert sch is not None
        assert loop_kinds(sch.mod["main"]).parallel == [4, 4]  # the rows of each of its two blocks
