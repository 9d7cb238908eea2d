"""Register-blocked direct NCHW convolution with its epilogue computed inside each output tile.

The accumulator tile is ``oc_tile`` output channels x ``ow_tile`` output columns: for every
(input channel, kh, kw) one vector of input columns is loaded and multiplied by ``oc_tile``
broadcast weights, so each load feeds ``oc_tile`` FMAs (the same reuse NCHWc kernels get from
their channel block, without layout transforms around every conv). Bias, activations, the
residual add and an SE input scale run on the tile before it is stored.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .helpers import extent, largest_divisor, schedule_pad, store_tile_epilogue, vectorized_init
from .matchers import ConvBlocks, conv_kernel, schedule_conv_tiles
from .target_info import vector_registers

# 16 accumulator vectors + input vector + broadcasts fit AVX-512's 32 registers; AVX2's 16
# leave room for 12 (16 spilled: 2.6 ms -> ? ms on a 192-channel 3x3 conv over 13x13). At two
# vectors of columns per tile, half as many channels.
_MAX_ACCUMULATORS = 16
_REGISTERS_KEPT_FREE = 4


class Conv2dNCHW(ScheduleRule):
    """Dense and grouped NCHW conv2d (any stride, padding, dilation) + fused epilogue."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = conv_kernel(func, target, depthwise=False)
        if found is None:
            return None
        sch, blocks, lanes = found
        accumulators = min(_MAX_ACCUMULATORS, vector_registers(target) - _REGISTERS_KEPT_FREE)
        # A strided conv gathers its input vectors: one vector of columns and twice the
        # channels gets each gathered vector twice the FMAs (measured 1.2-1.4x on 3x3/2 convs
        # with 160-320 output columns).
        max_vectors = 2 if blocks.column_stride == 1 else 1
        return schedule_conv_tiles(func, sch, blocks, lanes, max_vectors,
                                   lambda copy, copy_blocks, tile: self._schedule(copy, copy_blocks, tile, lanes, accumulators))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int, lanes: int, accumulators: int):
        """Tiles of ``oc_tile`` channels x ``ow_tile`` columns; returns the column-tile loop."""
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = blocks.tiled_loops(sch.get_loops(blocks.conv))
        vectors = -(-ow_tile // lanes)
        oc_tile = largest_divisor(extent(sch, f), accumulators // vectors)
        f_outer, f_inner = sch.split(f, [None, oc_tile])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, f_outer, y, x_outer, rc, ry, rx, f_inner, x_inner)
        store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
        sch.parallel(sch.fuse(n, f_outer, y))
        sch.unroll(f_inner)
        sch.vectorize(x_inner)
        vectorized_init(sch, blocks.conv, rc)
        return x_outer
