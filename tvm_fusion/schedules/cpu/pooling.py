"""Pooling (max/avg pool2d and global pools, NCHW and NCHW[x]c): rows across cores, output
columns (in NCHW[x]c the channel block) on vectors.

Legalized pooling reduces a kh x kw window per output element, with the window loops
innermost, so nothing vectorizes. Moving the window loops outside a tile of output columns
turns each tap into one vector max/add over the tile. A pad that leaves the vector's axis
alone (NCHW[x]c: the channel block) is read in the window, one select per vector; one along it
(NCHW columns) stays a pass of its own (``_leaves_innermost_axis``). A global pool (GlobalAveragePool,
``mean`` over H and W) reduces one contiguous map per channel: channels across cores.

With a symbolic image size the output rows and columns (and a global pool's reduced map) are
symbolic: window pools get full column tiles with the last one shifted back
(``symbolic_width.py``); a global pool over a symbolic map sums it in one scalar chain per
channel (vector partial sums need the map size to divide by the vector).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import OneReduction, is_static, only_reduction
from ...targets.target_info import vector_lanes
from .helpers import (extent, inline_cheap_blocks, iter_kinds, one_reduction_kernel, row_tile, schedule_pad,
                      store_tile_epilogue, vectorized_init)
from .symbolic_width import schedule_by_width, static_except, width_tiles
from .vector_sum import vectorize_reduction

# Unrolling beyond this many window taps bloats code for no gain.
_MAX_UNROLLED_TAPS = 49


class Pooling(ScheduleRule):
    """``[pad] -> window reduction (S..S R..R, one input) -> elementwise..``: max/avg/Lp pools
    in 1-D, 2-D and 3-D, and global pools."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        kernel = one_reduction_kernel(func, target)
        if kernel is None:
            return None
        sch, pool, stmt = kernel.sch, kernel.block, kernel.stmt
        kinds = iter_kinds(stmt)
        spatial = len(kinds) - len(kinds.lstrip("S"))
        if spatial < 3 or kinds != "S" * spatial + "R" * (len(kinds) - spatial) or spatial == len(kinds):
            return None  # not (batch, channel, positions..., window...)
        if not static_except(stmt, tuple(range(2, len(kinds)))):
            return None  # batch and channels must be static
        if len({read.source for read in stmt.reads} - {stmt.writes[0].source}) != 1:
            return None  # a window reduction reads one input; two would be a conv or a product
        loops = sch.get_loops(pool)
        lanes = vector_lanes(target, stmt.writes[0].source.dtype)
        if all(_is_unit(sch, loop) for loop in loops[2:spatial]):
            if not static_except(stmt, ()):
                # A symbolic map: one scalar sum per channel, channels across cores.
                channels = sch.fuse(*loops[:2])
                for block in kernel.epilogue:
                    sch.reverse_compute_at(block, channels, preserve_unit_loops=True)
                sch.parallel(channels)
                return sch
            return _global_pool(sch, pool, kernel.epilogue, sch.fuse(*loops[:2]), lanes)
        width = sch.get(loops[spatial - 1]).extent
        if is_static(width) and static_except(stmt, tuple(range(2, spatial - 1))):
            # Static columns; or, in NCHW[x]c, the channel block as the columns, under rows and
            # columns that may be symbolic.
            _window_pool(kernel, spatial, row_tile(int(width), lanes, max_vectors=4))
            return sch
        if not static_except(stmt, (spatial - 2, spatial - 1)):
            return None  # the window must be static; output rows and columns may not

        def schedule_copy(copy, tile):
            inline_cheap_blocks(copy)
            return _window_pool(only_reduction(copy), spatial, tile)

        return schedule_by_width(func, width, width_tiles(4 * lanes, lanes), schedule_copy)


def _is_unit(sch: s_tir.Schedule, loop) -> bool:
    loop_extent = sch.get(loop).extent
    return is_static(loop_extent) and int(loop_extent) == 1


def _window_pool(kernel: OneReduction, spatial: int, tile: int):
    """Window loops outside a tile of ``tile`` output columns; returns the column-tile loop."""
    sch, pool = kernel.sch, kernel.block
    loops = sch.get_loops(pool)
    outer, x, window = loops[:spatial - 1], loops[spatial - 1], loops[spatial:]
    in_window = [block for block in kernel.prologue if _leaves_innermost_axis(sch, block)]
    for block in in_window:
        sch.compute_inline(block)
    schedule_pad(sch, [block for block in kernel.prologue if block not in in_window])
    x_outer, x_inner = sch.split(x, [None, tile])
    sch.reorder(*outer, x_outer, *window, x_inner)
    store_tile_epilogue(sch, pool, kernel.epilogue, x_outer)
    sch.parallel(sch.fuse(*outer))
    taps = 1
    for loop in window:
        taps *= extent(sch, loop)
    if taps <= _MAX_UNROLLED_TAPS:
        for loop in window:
            sch.unroll(loop)
    sch.vectorize(x_inner)
    vectorized_init(sch, pool, window[0])
    return x_outer


def _leaves_innermost_axis(sch: s_tir.Schedule, block) -> bool:
    """Whether a block before the pool (its pad) copies its input's innermost axis as it is:
    in NCHW[x]c the channel block, the vector. Read in the window, its select then depends on
    the row and column only, one condition for the whole vector, which costs less than a pass
    of its own writing the padded map (opennsfw-tf's 3x3/2 max pool over 112x112 with 64
    channels, kernel alone, 2 threads: 149 -> 32 us). Where the pad is along the vector's axis
    (NCHW columns), every lane has a condition of its own, and the pass stays (a 5x5 max pool
    over 80x80 NCHW: 34 us as a pass, 132 in the window)."""
    stmt = sch.get(block)
    if len(stmt.reads) != 1 or len(stmt.writes) != 1:
        return False
    source, padded = stmt.reads[0].source, stmt.writes[0].source
    return (len(source.shape) == len(padded.shape) and is_static(source.shape[-1])
            and is_static(padded.shape[-1]) and int(source.shape[-1]) == int(padded.shape[-1]))


def _global_pool(sch: s_tir.Schedule, pool, epilogue: list, channels, lanes: int) -> s_tir.Schedule:
    """One channel's map per iteration, summed in vector partial sums, channels across cores,
    the epilogue (the mean's divide) right after each channel's sum."""
    vectorize_reduction(sch, pool, lanes)
    for block in epilogue:
        sch.reverse_compute_at(block, channels, preserve_unit_loops=True)
    sch.parallel(channels)
    return sch
