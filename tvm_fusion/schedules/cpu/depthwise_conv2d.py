"""Depthwise NCHW conv2d (one filter per channel) + fused epilogue.

A depthwise conv reuses no input across output channels, so the dense rule's channel tile
would only multiply the loads. Here each task owns whole channels, the kh x kw window is
unrolled over a tile of output columns held in vector registers, and the epilogue runs on
the tile before it is stored. A symbolic width gets full tiles with the last one shifted
back (``symbolic_width.py``).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .helpers import extent, schedule_pad, store_tile_epilogue, vectorized_init
from .matchers import ConvBlocks, conv_kernel, schedule_conv_tiles, split_column_phases

_MAX_VECTORS = 4

# Unrolling beyond this many window taps bloats code for no gain.
_MAX_UNROLLED_TAPS = 49


class DepthwiseConv2d(ScheduleRule):
    """Depthwise NCHW conv2d (``groups == channels``, one input channel per filter) + epilogue."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = conv_kernel(func, target, depthwise=True)
        return None if found is None else schedule_conv_tiles(func, *found, _MAX_VECTORS, self._schedule)

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int):
        """Whole channels per task, ``ow_tile`` columns per tile; returns the column-tile loop."""
        split_column_phases(sch, blocks)
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = blocks.tiled_loops(sch.get_loops(blocks.conv))
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, f, y, x_outer, rc, ry, rx, x_inner)
        store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
        sch.parallel(sch.fuse(n, f, y))
        if extent(sch, ry) * extent(sch, rx) <= _MAX_UNROLLED_TAPS:
            sch.unroll(ry)
            sch.unroll(rx)
        sch.vectorize(x_inner)
        vectorized_init(sch, blocks.conv, rc)
        return x_outer
