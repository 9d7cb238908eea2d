"""Depthwise NCHW conv2d (one filter per channel) + fused epilogue.

A depthwise conv reuses no input across output channels, so the dense rule's channel tile
would only multiply the loads. Here each task owns whole channels, the kh x kw window is
unrolled over a tile of output columns held in vector registers, and the epilogue runs on
the tile before it is stored.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .conv2d_nchw import extent, match_conv, row_tile, schedule_pad, store_tile_epilogue
from .target_info import vector_lanes

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
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = sch.get_loops(blocks.conv)
        ow_tile = row_tile(extent(sch, x), lanes, max_vectors=4)
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
        return sch
