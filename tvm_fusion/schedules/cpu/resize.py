"""Resize (NCHW) and what is fused onto it (an add, an activation, a channel concat): rows
across cores, output columns on vectors.

The Injective rule fuses all four axes into one loop, so every vector lane re-derives
(n, c, y, x) by division and a concat picks its input per lane. Keeping (n, c, y) as the
parallel row loop and vectorizing only the columns makes the source row, the interpolation
weights in y and the concat's choice of input loop-invariant per row; only the column
gather (x // 2 for a nearest 2x) varies across lanes.

Rows and columns may be symbolic (a model compiled for a range of sizes): the column tiles are
then full, the last one of a row shifted back, one copy per tile width (``symbolic_width.py``).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial, is_static
from ...targets.target_info import vector_lanes
from .helpers import cpu_schedule, extent, inline_cheap_blocks, row_tile
from .symbolic_width import schedule_by_width, static_except, width_tiles

# Below this many output elements a parallel launch costs more than the loop itself.
_MIN_PARALLEL_ELEMENTS = 4096
_MAX_VECTORS = 4


class Resize(ScheduleRule):
    """All-spatial kernels with a legalized ``image.resize2d`` block (topi names it ``resize``)
    whose remaining blocks are 4-D: with static extents, or one block with static batch and
    channels; or all 5-D (NCHW[x]c) with static extents."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        if sch is None:
            return None
        blocks = sch.get_child_blocks(get_root_block(sch))
        if not all(is_spatial(sch.get(b)) for b in blocks):
            return None
        if not any(_is_resize(sch, b) for b in blocks):
            return None
        inline_cheap_blocks(sch)
        # A linear resize calls floor, which keeps inline_cheap_blocks away; it is still read
        # once per consumer element, so inlining it recomputes nothing.
        for block in sch.get_child_blocks(get_root_block(sch)):
            if not _is_resize(sch, block):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue  # the kernel's output, or read by several consumers
        remaining = sch.get_child_blocks(get_root_block(sch))
        nests = [sch.get_loops(b) for b in remaining]
        if nests and all(len(loops) == 5 for loops in nests):
            return _schedule_blocked(sch, remaining, nests, target)
        if any(len(loops) != 4 for loops in nests):
            return None
        if all(is_static(sch.get(loop).extent) for loops in nests for loop in loops):
            if len(remaining) == 1 and (channel_block := _blocked_source(sch.get(remaining[0]))):
                return _schedule_unblocking(sch, remaining[0], channel_block)
            for block, (n, c, y, x) in zip(remaining, nests):
                lanes = vector_lanes(target, sch.get(block).writes[0].source.dtype)
                elements = extent(sch, n) * extent(sch, c) * extent(sch, y) * extent(sch, x)
                rows = sch.fuse(n, c, y)
                tile = row_tile(extent(sch, x), lanes, max_vectors=_MAX_VECTORS)
                columns = sch.split(x, [None, tile])[1] if tile < extent(sch, x) else x
                if tile > 1:
                    sch.vectorize(columns)
                if elements >= _MIN_PARALLEL_ELEMENTS:
                    sch.parallel(rows)
            return sch
        # Symbolic rows and columns (a model compiled for a range of sizes): one block left,
        # static batch and channels; full column tiles, the last one of a row shifted back.
        if len(remaining) != 1 or not static_except(sch.get(remaining[0]), (2, 3)):
            return None
        lanes = vector_lanes(target, sch.get(remaining[0]).writes[0].source.dtype)
        width = sch.get(nests[0][3]).extent
        return schedule_by_width(sch.mod["main"], width, width_tiles(_MAX_VECTORS * lanes, lanes), _tile_rows)


def _schedule_blocked(sch: s_tir.Schedule, blocks, nests, target: Target) -> s_tir.Schedule | None:
    """NCHW[x]c maps (a blocked FPN merge): the channel block is contiguous, one vector per
    pixel; rows across cores. Static extents only."""
    if not all(is_static(sch.get(loop).extent) for loops in nests for loop in loops):
        return None
    for block, (n, c, y, _x, lane) in zip(blocks, nests):
        lanes = vector_lanes(target, sch.get(block).writes[0].source.dtype)
        if extent(sch, lane) % lanes == 0:
            sch.vectorize(lane)
        if extent(sch, n) * extent(sch, c) * extent(sch, y) > 1:
            sch.parallel(sch.fuse(n, c, y))
    return sch


def _blocked_source(block: s_tir.SBlock) -> int:
    """The channel block of a blocked (5-D) map ``block`` reads, 0 if it reads none."""
    blocked = [int(region.source.shape[-1]) for region in block.reads if len(region.source.shape) == 5
               and is_static(region.source.shape[-1])]
    return max(blocked, default=0)


def _schedule_unblocking(sch: s_tir.Schedule, block, channel_block: int) -> s_tir.Schedule:
    """A resize of a blocked map written in NCHW (a segmentation head's upsampling of its
    class maps to the image, the layout transform fused): rows of one channel block across
    cores, each pixel's channels of the block unrolled innermost. Their source pixels and
    interpolation weights are computed once per pixel and their loads are contiguous; with
    the columns on vectors instead, every load was a gather of one channel (lraspp's
    21 x 256 x 320 logits: 8.0 -> 3.3-3.6 ms kernel alone, Zen 1)."""
    n, c, y, x = sch.get_loops(block)
    channel_blocks, lane = sch.split(c, [None, channel_block])
    sch.reorder(n, channel_blocks, y, x, lane)
    sch.parallel(sch.fuse(n, channel_blocks, y))
    sch.unroll(lane)
    return sch


def _tile_rows(sch: s_tir.Schedule, tile: int):
    """(n, c, y) rows across cores, ``tile`` columns per vector tile; returns the tile loop."""
    (block,) = sch.get_child_blocks(get_root_block(sch))
    n, c, y, x = sch.get_loops(block)
    rows = sch.fuse(n, c, y)
    outer, columns = sch.split(x, [None, tile])
    if tile > 1:
        sch.vectorize(columns)
    sch.parallel(rows)
    return outer


def _is_resize(sch: s_tir.Schedule, block) -> bool:
    return sch.get(block).name_hint.startswith("resize")
