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

from .conv2d_nchw import ConvBlocks, extent, match_conv, row_tile, schedule_pad, store_tile_epilogue
from .symbolic_width import is_static, schedule_by_width, width_tiles
from .target_info import vector_lanes

_MAX_VECTORS = 4

# Unrolling beyond this many window taps bloats code for no gain.
_MAX_UNROLLED_TAPS = 49


class DepthwiseConv2d(ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        blocks = match_conv(sch)
        if blocks is None or not blocks.depthwise:
            return None
        dtype = sch.get(blocks.conv).writes[0].source.dtype
        lanes = vector_lanes(target, dtype)
        width = sch.get(sch.get_loops(blocks.conv)[3]).extent
        if is_static(width):
            self._schedule(sch, blocks, row_tile(int(width), lanes, _MAX_VECTORS))
            return sch
        return schedule_by_width(func, width, width_tiles(_MAX_VECTORS * lanes, lanes),
                                 lambda copy, tile: self._schedule(copy, match_conv(copy), tile))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int):
        """Whole channels per task, ``ow_tile`` columns per tile; returns the column-tile loop."""
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = sch.get_loops(blocks.conv)
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, f, y, x_outer, rc, ry, rx, x_inner)
        store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
        sch.parallel(sch.fuse(n, f, y))
        if extent(sch, ry) * extent(sch, rx) <= _MAX_UNROLLED_TAPS:
            sch.unroll(ry)
            sch.unroll(rx)
        sch.vectorize(x_inner)
        init = sch.decompose_reduction(blocks.conv, rc)
        sch.vectorize(sch.get_loops(init)[-1])
        return x_outer
