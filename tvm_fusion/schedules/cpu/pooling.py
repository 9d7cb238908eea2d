"""Pooling (max/avg pool2d and global pools, NCHW): rows across cores, output columns on vectors.

Legalized pooling reduces a kh x kw window per output element, with the window loops
innermost, so nothing vectorizes. Moving the window loops outside a tile of output columns
turns each tap into one vector max/add over the tile. A global pool (GlobalAveragePool,
``mean`` over H and W) reduces one contiguous map per channel: channels across cores.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .conv2d_nchw import extent, row_tile, schedule_pad, store_tile_epilogue
from .inline import has_static_extents, iter_kinds, one_reduction_kernel
from .target_info import vector_lanes
from .vector_sum import vectorize_reduction

# Unrolling beyond this many window taps bloats code for no gain.
_MAX_UNROLLED_TAPS = 49


class Pooling(ScheduleRule):
    """``[pad] -> window reduction (S..S R..R, one input) -> elementwise..``: max/avg/Lp pools
    in 1-D, 2-D and 3-D, and global pools."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = one_reduction_kernel(func, target)
        if found is None:
            return None
        sch, blocks, index = found
        pool = blocks[index]
        stmt = sch.get(pool)
        kinds = iter_kinds(stmt)
        spatial = len(kinds) - len(kinds.lstrip("S"))
        if spatial < 3 or kinds != "S" * spatial + "R" * (len(kinds) - spatial) or spatial == len(kinds):
            return None  # not (batch, channel, positions..., window...)
        if not has_static_extents(stmt):
            return None
        if len({read.source for read in stmt.reads} - {stmt.writes[0].source}) != 1:
            return None  # a window reduction reads one input; two would be a conv or a product
        loops = sch.get_loops(pool)
        outer, x, window = loops[:spatial - 1], loops[spatial - 1], loops[spatial:]
        epilogue = list(blocks[index + 1:])
        lanes = vector_lanes(target, stmt.writes[0].source.dtype)
        if all(extent(sch, loop) == 1 for loop in loops[2:spatial]):
            return _global_pool(sch, pool, epilogue, sch.fuse(*loops[:2]), lanes)
        schedule_pad(sch, list(blocks[:index]))
        x_outer, x_inner = sch.split(x, [None, row_tile(extent(sch, x), lanes, max_vectors=4)])
        sch.reorder(*outer, x_outer, *window, x_inner)
        store_tile_epilogue(sch, pool, epilogue, x_outer)
        sch.parallel(sch.fuse(*outer))
        taps = 1
        for loop in window:
            taps *= extent(sch, loop)
        if taps <= _MAX_UNROLLED_TAPS:
            for loop in window:
                sch.unroll(loop)
        sch.vectorize(x_inner)
        init = sch.decompose_reduction(pool, window[0])
        sch.vectorize(sch.get_loops(init)[-1])
        return sch


def _global_pool(sch: s_tir.Schedule, pool, epilogue: list, channels, lanes: int) -> s_tir.Schedule:
    """One channel's map per iteration, summed in vector partial sums, channels across cores,
    the epilogue (the mean's divide) right after each channel's sum."""
    vectorize_reduction(sch, pool, lanes)
    for block in epilogue:
        sch.reverse_compute_at(block, channels, preserve_unit_loops=True)
    sch.parallel(channels)
    return sch
