"""Depthwise conv2d in the blocked channel layout NCHW[x]c (passes/blocked_layout.py) + epilogue.

A channel block's filters sit side by side, so each window tap is one contiguous vector of
input channels times one contiguous vector of weights, whatever the map's width or the conv's
stride: no column tiling to fit the row, no gathered loads at stride 2, and the layout of the
dense convs around it is kept (no transforms around each depthwise conv). The accumulator tile
is ``ow_tile`` pixels of one row, one vector each; the window is unrolled over it and the
epilogue runs on the tile before it is stored.

A task is a band of output rows of one channel block that pads the input rows it reads
itself (``padded_band_rows``). A symbolic row count keeps a padding pass over the whole map.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_static, only_reduction
from ...targets.target_info import num_cores, vector_lanes
from .helpers import (extent, iter_kinds, one_reduction_kernel, padded_band_rows, pixel_tile, schedule_pad,
                      store_tile_epilogue, vectorized_init)
from .symbolic_width import schedule_by_width, schedule_static_width, static_except, width_tiles

# Pixels per tile: 8 accumulators fit AVX2's 16 registers beside the weight vectors.
_MAX_ROW_TILE = 8
_MIN_EXACT_TILE = 4
_MAX_UNROLLED_TAPS = 49


class DepthwiseConv2dNCHWc(ScheduleRule):
    """``[pad] -> depthwise_conv2d_nchwc (S S S S S R R) -> elementwise..``."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        kernel = one_reduction_kernel(func, target)
        if kernel is None or iter_kinds(kernel.stmt) != "SSSSSRR" or not static_except(kernel.stmt, (2, 3)):
            return None
        sch, stmt = kernel.sch, kernel.stmt
        if len(stmt.reads) != 2 or any(len(read.source.shape) != 5 for read in stmt.reads):
            return None  # one 5-D map and one 5-D blocked weight
        lanes = vector_lanes(target, stmt.writes[0].source.dtype)
        loops = sch.get_loops(kernel.block)
        if extent(sch, loops[4]) > lanes or lanes % extent(sch, loops[4]):
            return None  # the channel block must fit one vector register
        banded = kernel.prologue and is_static(stmt.iter_vars[2].dom.extent)
        band = padded_band_rows(stmt, stmt.reads[0].source, num_cores(target)) if banded else None

        def schedule(sch: s_tir.Schedule, ow_tile: int):
            return self._schedule(sch, ow_tile, band)

        width = sch.get(loops[3]).extent
        if is_static(width):
            width = int(width)
            return schedule_static_width(sch, width, pixel_tile(width, _MAX_ROW_TILE, _MIN_EXACT_TILE), schedule)
        return schedule_by_width(sch.mod["main"], width, width_tiles(_MAX_ROW_TILE, lanes), schedule)

    @staticmethod
    def _schedule(sch: s_tir.Schedule, ow_tile: int, band: int | None):
        """Bands of ``band`` rows across cores, each padding its own input rows (the whole map
        padded first when ``band`` is None), ``ow_tile`` pixels a tile; returns the pixel-tile loop."""
        kernel = only_reduction(sch)
        conv = kernel.block
        n, c, y, x, b, ky, kx = sch.get_loops(conv)
        if band is None:
            schedule_pad(sch, kernel.prologue)
        y_outer, y_inner = sch.split(y, [None, band or 1])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, c, y_outer, y_inner, x_outer, ky, kx, x_inner, b)
        store_tile_epilogue(sch, conv, kernel.epilogue, x_outer)
        task = sch.fuse(n, c, y_outer)
        sch.parallel(task)
        if band is not None:
            for producer in reversed(kernel.prologue):
                sch.compute_at(producer, task)
                sch.vectorize(sch.get_loops(producer)[-1])
        if extent(sch, ky) * extent(sch, kx) <= _MAX_UNROLLED_TAPS:
            sch.unroll(ky)
            sch.unroll(kx)
        sch.unroll(x_inner)
        sch.vectorize(b)
        vectorized_init(sch, conv, ky)
        return x_outer
