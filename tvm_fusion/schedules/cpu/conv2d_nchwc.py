"""Conv2d in the blocked channel layout NCHW[x]c (passes/blocked_layout.py) + fused epilogue.

The accumulator tile is ``ow_tile`` output pixels of one row x ``oc_tile`` channel blocks, one
vector register each. For every (input channel block, ky, kx, input channel) one input value
per pixel is broadcast and multiplied into ``oc_tile`` contiguous weight vectors, so each
load feeds ``ow_tile * oc_tile`` FMAs and no load is strided, whatever the conv's stride.
Bias, activations and the residual add run on the tile before it is stored. Rows and columns
may be symbolic (a model compiled for a range of sizes): the pixel tiles are then full, the
last of a row shifted back, one copy per tile width (``symbolic_width.py``).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .helpers import (extent, iter_kinds, largest_divisor, one_reduction_kernel, only_reduction, schedule_pad,
                      store_tile_epilogue, vectorized_init)
from .symbolic_width import is_static, schedule_by_width, static_except, width_tiles
from .target_info import vector_lanes, vector_registers

# Output pixels per tile: with two channel blocks, 16 accumulators of AVX-512's 32 registers,
# leaving room for the weight vectors and the broadcast input (measured on resnet_tiny: 7-8
# beat 14 and 28, whose tiles spill).
_MAX_ROW_TILE = 8


class Conv2dNCHWc(ScheduleRule):
    """``[pad] -> conv2d_nchwc (S S S S S R R R R) -> elementwise..``."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        kernel = one_reduction_kernel(func, target)
        if kernel is None or iter_kinds(kernel.stmt) != "SSSSSRRRR" or not static_except(kernel.stmt, (2, 3)):
            return None
        sch, stmt = kernel.sch, kernel.stmt
        if any(len(read.source.shape) not in (5, 6) for read in stmt.reads) or len(stmt.reads) != 2:
            return None  # one 5-D map and one 6-D blocked weight
        lanes = vector_lanes(target, stmt.writes[0].source.dtype)
        loops = sch.get_loops(kernel.block)
        if extent(sch, loops[4]) > lanes or lanes % extent(sch, loops[4]):
            return None  # the channel block must fit one vector register
        registers = vector_registers(target)
        width = sch.get(loops[3]).extent
        if is_static(width):
            self._schedule(sch, registers, largest_divisor(int(width), _MAX_ROW_TILE))
            return sch
        # Symbolic rows and columns: full tiles of pixels, the last of a row shifted back.
        return schedule_by_width(sch.mod["main"], width, width_tiles(_MAX_ROW_TILE, lanes),
                                 lambda copy, tile: self._schedule(copy, registers, tile))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, registers: int, ow_tile: int):
        """Tiles of ``ow_tile`` pixels x ``oc_tile`` channel blocks; returns the pixel-tile loop."""
        kernel = only_reduction(sch)
        conv = kernel.block
        n, oc, y, x, ob, ic, ky, kx, ib = sch.get_loops(conv)
        schedule_pad(sch, kernel.prologue)
        # 16-register ISAs (AVX2) get half the tile: one channel block.
        oc_tile = 2 if extent(sch, oc) % 2 == 0 and 2 * ow_tile <= registers // 2 else 1
        oc_outer, oc_inner = sch.split(oc, [None, oc_tile])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, oc_outer, y, x_outer, ic, ky, kx, ib, oc_inner, x_inner, ob)
        store_tile_epilogue(sch, conv, kernel.epilogue, x_outer)
        sch.parallel(sch.fuse(n, oc_outer, y))
        sch.unroll(oc_inner)
        sch.unroll(x_inner)
        sch.vectorize(ob)
        vectorized_init(sch, conv, ic)
        return x_outer
