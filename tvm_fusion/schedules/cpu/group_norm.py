"""GroupNorm (TOPI's group_norm, with what FuseOps put after it): one (sample, group) per task."""

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...targets.target_info import vector_lanes
from .helpers import (cpu_schedule, extent, is_spatial, parallel_rows, row_blocks, vectorize_innermost,
                      vectorized_init)
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small

# The normalized block of TOPI's group_norm, as LegalizeOps names it: (N, G, C / G, spatial...).
GROUP_NORM_BLOCK = "T_group_norm"


class GroupNorm(ScheduleRule):
    """The statistics of a group (its channels and positions, one sum and one sum of squares) and
    its normalized channels in one task, tasks across cores.

    ``Reduction`` declines the kernel: TOPI computes the norm on the (N, G, C / G, ...) view and
    reshapes it back, and what FuseOps adds after it (a SiLU) iterates (N, C, ...), so the blocks
    do not share rows. Here each block after the norm is re-indexed as (N, G, C / G, ...) (the
    same elements, in the same order), the norm is inlined where one block reads it, and each
    group is summed in vectors of partial sums and normalized while still in cache.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target, inline_cheap=True)
        norm = None if sch is None else _norm_block(sch)
        if norm is None:
            return None
        groups, per_group = (sch.get(norm).iter_vars[axis].dom.extent for axis in (1, 2))
        if not all(isinstance(e, tirx.IntImm) for e in (groups, per_group)):
            return None
        try:
            for block in sch.get_child_blocks(get_root_block(sch)):
                stmt = sch.get(block)
                if _per_channel(stmt, int(groups) * int(per_group)):
                    by_group = tirx.IndexMap.from_func(lambda n, c, *rest: (n, c // per_group, c % per_group, *rest),
                                                       ndim=len(stmt.iter_vars))
                    sch.transform_block_layout(block, by_group)
            consumers = sch.get_consumers(norm)
            if len(consumers) == 1:
                sch.compute_inline(norm)  # its rsqrt is per element either way; the consumer writes it out
        except s_tir.ScheduleError:
            return None  # a layout this rule did not foresee: leave it to the next rule
        rows = row_blocks(sch)  # (N, G), or (G,) where N is 1
        if rows is None:
            return None
        blocks, row_axes = rows
        lanes = vector_lanes(target, sch.get(blocks[-1].block_rv).writes[0].source.dtype)
        try:
            _rows(sch, [block.block_rv for block in blocks], row_axes, lanes)
        except s_tir.ScheduleError:
            return None  # a shape this rule did not foresee: leave it to the next rule
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)


def _rows(sch: s_tir.Schedule, blocks: list, row_axes: int, lanes: int) -> None:
    """One row (a group) per parallel task: its partial sums, its statistics, its channels."""
    order, partials = [], []
    for block in blocks:  # rfactor needs the statistics still at the root: split them first
        partial = None if is_spatial(sch.get(block)) else _lane_partial_sums(sch, block, lanes)
        if partial is not None:
            order.append(partial)
            partials.append(partial)
        order.append(block)
    row = sch.fuse(*sch.get_loops(order[-1])[:row_axes])
    parallel_rows(sch, row)
    for block in reversed(order[:-1]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    for block in order:
        if is_spatial(sch.get(block)):
            vectorize_innermost(sch, block, row, lanes)
        elif any(sch.get(block).same_as(sch.get(p)) for p in partials):
            _vectorize_lanes(sch, block, row_axes)


def _norm_block(sch: s_tir.Schedule):
    """The group norm's normalized block, when the kernel has one (and one reduction before it)."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    norm = next((b for b in blocks if sch.get(b).name_hint == GROUP_NORM_BLOCK), None)
    reductions = [b for b in blocks if not is_spatial(sch.get(b))]
    if norm is None or len(reductions) != 1 or len(sch.get(norm).iter_vars) < 4:
        return None
    return norm


def _per_channel(block: s_tir.SBlock, channels: int) -> bool:
    """A spatial block over (N, C, ...): what follows the norm, indexed by channel."""
    axes = block.iter_vars
    return (is_spatial(block) and block.name_hint != GROUP_NORM_BLOCK and len(axes) >= 3
            and isinstance(axes[1].dom.extent, tirx.IntImm) and int(axes[1].dom.extent) == channels)


def _lane_partial_sums(sch: s_tir.Schedule, block, lanes: int):
    """The group's sum and sum of squares as ``lanes`` interleaved partial sums each (rfactor of
    the fused reduction), or None where the group does not divide into whole vectors."""
    stmt = sch.get(block)
    reductions = sum(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars)
    loops = sch.get_loops(block)[-reductions:]
    sizes = [extent(sch, loop) for loop in loops]
    if not all(isinstance(size, int) for size in sizes) or math.prod(sizes) <= lanes or math.prod(sizes) % lanes:
        return None
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    _, lane = sch.split(fused, [None, lanes])
    return sch.rfactor(lane, factor_axis=len(stmt.iter_vars) - reductions)


def _vectorize_lanes(sch: s_tir.Schedule, partial, row_axes: int) -> None:
    """Under the row loop, the partial sums' loops are: lane, the (unit) row axes, the rest of
    the reduction. The lane loop goes innermost as one vector; its init likewise."""
    loops = sch.get_loops(partial)
    lane, reduction = loops[-(row_axes + 2)], loops[-1]
    sch.reorder(reduction, lane)
    sch.vectorize(lane)  # before decompose_reduction: the update alone is no reduction block
    vectorized_init(sch, partial, reduction)
