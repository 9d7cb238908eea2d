"""Softmax over an axis that is not the innermost one (YOLOv8's distribution head: a softmax
over 16 bins on axis 1 of 1 x 16 x 4 x anchors), vectors along the innermost axis.

``Softmax`` reduces along contiguous rows; here the reduced values of one output lie a whole
stride apart, so its row schedule does not apply and the kernel fell to ``Fallback`` (scalar
max, exp and sum passes over the whole tensor: 493 us for nudenet's 134k elements on Zen 1).
Instead, a task is a vector of neighbouring positions along the innermost axis: their max, exp
and sum run on vectors down the reduced axis, each step one contiguous load, and the task's
slice stays in L1 from the max to the normalized store.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...targets.target_info import vector_lanes
from .helpers import (cpu_schedule, extent, extent_of, inline_cheap_blocks, power_of_two_width,
                      vectorized_init)
from .matchers import is_softmax
from .small_extent import MIN_PARALLEL_ELEMENTS

# Narrower vectors than this along the innermost axis are not worth the rule (Fallback runs it).
_MIN_LANES = 4


class SoftmaxOverOuterAxis(ScheduleRule):
    """[prologue] -> max -> exp -> sum -> normalize [-> epilogue], reduced over an outer axis."""

    runs_after = ("Softmax",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        if sch is None or not is_softmax(sch):
            return None
        inline_cheap_blocks(sch)
        blocks = list(sch.get_child_blocks(get_root_block(sch)))
        output = blocks[-1]
        loops = sch.get_loops(output)
        extents = [extent(sch, loop) for loop in loops]
        reduced = _reduced_axis(sch, blocks, len(loops))
        if reduced is None or reduced == len(loops) - 1 or not all(isinstance(e, int) for e in extents):
            return None
        if not _vectors_along_softmax_rows(sch, blocks, extents[-1]):
            return None
        lanes = power_of_two_width(extents[-1], vector_lanes(target, str(sch.get(output).writes[0].source.dtype)))
        if lanes < _MIN_LANES:
            return None
        try:
            scheduled = _schedule(sch, blocks, loops, reduced, lanes,
                                  parallel=math.prod(extents) >= MIN_PARALLEL_ELEMENTS)
        except s_tir.ScheduleError:
            return None  # a prologue or epilogue that does not follow the output's positions
        return sch if scheduled else None


def _schedule(sch: s_tir.Schedule, blocks: list, loops: list, reduced: int, lanes: int, parallel: bool) -> bool:
    """Tasks of ``lanes`` neighbouring positions (the output's ``loops`` but the ``reduced``
    one); every block before the output computed per task. False (``sch`` half done, to be
    dropped) where a reduction computed per task has no reduce loop or no vector of ``lanes``
    positions to run on."""
    outer, lane = sch.split(loops[-1], [None, lanes])
    kept = [loop for i, loop in enumerate(loops[:-1]) if i != reduced]
    sch.reorder(*kept, outer, loops[reduced], lane)
    task = sch.fuse(*kept, outer)
    if parallel:
        sch.parallel(task)
    for block in reversed(blocks[:-1]):
        sch.compute_at(block, task, preserve_unit_loops=True)
    for block in blocks[:-1]:
        inner = sch.get_loops(block)[1:]
        if is_spatial(sch.get(block)):
            sch.vectorize(inner[-1])
            continue
        # (positions, reduced) after compute_at: the reduced axis outside, the vector inside.
        reduce_loop = next((loop for loop in inner if _is_reduce_loop(sch, block, loop)), None)
        if reduce_loop is None:
            return False
        position = next((loop for loop in reversed(inner) if not loop.same_as(reduce_loop)
                         and extent(sch, loop) == lanes), None)
        if position is None:
            return False
        sch.reorder(reduce_loop, position)
        sch.vectorize(position)
        vectorized_init(sch, block, reduce_loop)
    sch.vectorize(lane)
    return True


def _vectors_along_softmax_rows(sch: s_tir.Schedule, blocks: list, width: int) -> bool:
    """True if the max and the sum run over as many innermost positions as the output (``width``):
    the rule's vectors of the output's innermost axis are then vectors of the softmax's own. An
    epilogue that broadcasts the softmax along that axis (attention pooling: weights over time
    of [batch, time, 1] times features [batch, time, dim]) leaves one position per task there,
    and no vector to run the reductions on."""
    for block in blocks:
        stmt = sch.get(block)
        if is_spatial(stmt):
            continue
        positions = stmt.iter_vars[:-1]  # the reduced axis is the last (``is_softmax``)
        if not positions or extent_of(positions[-1].dom.extent) != width:
            return False
    return True


def _reduced_axis(sch: s_tir.Schedule, blocks: list, rank: int) -> int | None:
    """The axis of the softmax's input that the max reduces over (its reduce variable's index)."""
    first = next(block for block in blocks if not is_spatial(sch.get(block)))
    stmt = sch.get(first)
    reduce_var = stmt.iter_vars[-1].var
    for region in stmt.reads:
        if len(region.region) != rank:
            continue
        for axis, span in enumerate(region.region):
            if isinstance(span.min, tirx.Var) and span.min.same_as(reduce_var):
                return axis
    return None


def _is_reduce_loop(sch: s_tir.Schedule, block, loop) -> bool:
    realize = get_sblockrealize(sch, block)
    for iv, value in zip(sch.get(block).iter_vars, realize.iter_values):
        if iv.iter_type == tirx.IterVar.CommReduce and isinstance(value, tirx.Var):
            return value.same_as(sch.get(loop).loop_var)
    return False
