"""Depthwise NCHW conv2d (one filter per channel) + fused epilogue.

A depthwise conv reuses no input across output channels, so the dense rule's channel tile
would only multiply the loads. Here each task owns whole channels, the kh x kw window is
unrolled over a tile of output columns held in vector registers, and the epilogue runs on
the tile before it is stored. A symbolic width gets full tiles with the last one shifted
back (``symbolic_width.py``). With a static row count and stride 1, a task is a band of a
channel's output rows that pads the input rows it reads (``padded_band_rows``), not a pass
over the whole map.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_static
from ...targets.target_info import num_cores
from .helpers import extent, padded_band_rows, schedule_pad, store_tile_epilogue, vectorized_init
from .matchers import ConvBlocks, conv_kernel, schedule_conv_tiles, split_column_phases, splits_column_phases

_MAX_VECTORS = 4

# Unrolling beyond this many window taps bloats code for no gain.
_MAX_UNROLLED_TAPS = 49


class DepthwiseConv2d(ScheduleRule):
    """Depthwise NCHW conv2d (``groups == channels``, one input channel per filter) + epilogue."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = conv_kernel(func, target, depthwise=True)
        cores = num_cores(target)
        return None if found is None else schedule_conv_tiles(
            func, *found, _MAX_VECTORS, lambda sch, blocks, ow_tile: self._schedule(sch, blocks, ow_tile, cores))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int, cores: int):
        """Bands of a channel's rows per task, ``ow_tile`` columns per tile; returns the
        column-tile loop."""
        # A stride-2 map whose columns are split into phases keeps its pass: its per-task copy
        # measured 0.6-2.1x the pass (Zen 1, 3x3 and 5x5 over 28x28 to 160x160); at stride 1
        # the band was 1.0-1.8x faster (most on maps of 7-14 rows).
        phases = splits_column_phases(sch, blocks)
        split_column_phases(sch, blocks)
        conv = sch.get(blocks.conv)
        banded = (blocks.pad and not phases and not blocks.tiles_rows and is_static(conv.iter_vars[2].dom.extent))
        band = padded_band_rows(conv, sch.get(blocks.pad[-1]).writes[0].source, cores) if banded else 1
        if not banded:
            schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = blocks.tiled_loops(sch.get_loops(blocks.conv))
        y_outer, y_inner = sch.split(y, [None, band])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, f, y_outer, y_inner, x_outer, rc, ry, rx, x_inner)
        store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
        task = sch.fuse(n, f, y_outer)
        sch.parallel(task)
        if banded:
            for producer in reversed(blocks.pad):
                sch.compute_at(producer, task)
        if extent(sch, ry) * extent(sch, rx) <= _MAX_UNROLLED_TAPS:
            sch.unroll(ry)
            sch.unroll(rx)
        sch.vectorize(x_inner)
        vectorized_init(sch, blocks.conv, rc)
        return x_outer
