"""GroupNorm: one (sample, group) per task, its statistics in vectors of partial sums, then its channels."""

import math

import pytest
import tvm
import tvm_ffi
from loop_structure import blocks_under_parallel_loop, loop_kinds, root_loop_nests
from tvm.relax.op import nn

from tvm_fusion.schedules.cpu.group_norm import GroupNorm

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # float32; the group's sums add in another order


def group_norm(groups: int, silu: bool = False):
    """``nn.group_norm`` over every axis after the channels [then SiLU, which FuseOps puts in its kernel]."""

    def norm(x, gamma, beta):
        out = nn.group_norm(x, gamma, beta, groups, channel_axis=1, axes=list(range(2, len(x.ty.shape))))
        return nn.silu(out) if silu else out

    return norm


def rfactored(func) -> bool:
    names = []
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda block: names.append(block.name_hint)))
    return any(name.endswith("_rf_update") for name in names)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("shape, groups", [((2, 64, 16, 16), 32), ((1, 320, 8, 8), 32), ((2, 12, 64), 4)])
def test_one_group_per_task_matches_unscheduled(assert_schedule_matches, lanes, shape, groups, silu):
    funcs = assert_schedule_matches(GroupNorm(), group_norm(groups, silu), **TOLERANCE, x=shape,
                                    gamma=(shape[1],), beta=(shape[1],))
    [func] = funcs.values()
    loops = loop_kinds(func)
    batch = shape[0]
    assert loops.parallel == [batch * groups]  # a unit batch leaves the groups alone
    assert "x_red_temp" in blocks_under_parallel_loop(func)  # each task sums its own group
    assert (shape[1] // groups * math.prod(shape[2:])) % lanes == 0 and rfactored(func)  # vectors of partial sums
    assert loops.vectorized[:2] == [lanes, lanes]  # their init and their update
    row = shape[-1]
    normalized = lanes if row > lanes and row % lanes == 0 else row
    assert loops.vectorized[2:] == [normalized] * (3 if silu else 1)  # the norm [, sigmoid, product]


def test_a_group_that_is_no_whole_number_of_vectors_sums_in_scalars(assert_schedule_matches):
    funcs = assert_schedule_matches(GroupNorm(), group_norm(3), **TOLERANCE, x=(1, 6, 3, 3), gamma=(6,), beta=(6,))
    [func] = funcs.values()
    assert not rfactored(func)
    assert loop_kinds(func).parallel == [3]


@pytest.mark.parametrize("shape", [(1, 8, 4, 4), (1, 16, 32)])
def test_one_group_of_one_sample_is_one_serial_task(assert_schedule_matches, lanes, shape):
    """A single (sample, group) row: normalize_prim_func keeps the statistics' unit row but drops
    it from the channels, and the rule took no such kernel before; now one serial loop nest,
    its sums still in vectors of partial sums."""
    funcs = assert_schedule_matches(GroupNorm(), group_norm(1, silu=True), **TOLERANCE, x=shape,
                                    gamma=(shape[1],), beta=(shape[1],))
    [func] = funcs.values()
    loops = loop_kinds(func)
    assert loops.parallel == [] and root_loop_nests(func) == 1
    assert rfactored(func) and loops.vectorized[:2] == [lanes, lanes]


def test_declines_other_norms(lowered, prim_funcs, target):
    mod = lowered(lambda x, gamma, beta: nn.layer_norm(x, gamma, beta, axes=[-1]), x=(8, 32), gamma=(32,),
                  beta=(32,))
    for func in prim_funcs(mod).values():
        assert GroupNorm().apply(func, target, False) is None
