"""Conv2d in the blocked channel layout NCHW[x]c (passes/blocked_layout.py) + fused epilogue.

The accumulator tile is ``ow_tile`` output pixels of one row x ``oc_tile`` channel blocks, one
vector register each. For every (input channel block, ky, kx, input channel) one input value
per pixel is broadcast and multiplied into ``oc_tile`` contiguous weight vectors, so each
load feeds ``ow_tile * oc_tile`` FMAs and no load is strided, whatever the conv's stride.
An SE gate scaling the input (``conv_epilogue``'s scaled variants), or the dequantization of
a quantized map's bytes, is applied once per value, not inlined into the loads (that cost a
multiply or a conversion per broadcast). The pad and the scale are
computed in each task: a task prepares the input rows its output row reads, in cache, and
runs every channel tile of the row on them (rows that do not share out evenly over the cores:
tasks are rows x channel tiles, each preparing its rows itself); a deep conv over a small map,
its filters several times the map, has tasks of channel tiles over the whole map instead, so
that each filter is read once. Bias,
activations and the residual add run on the tile before it is stored. Rows and columns may be
symbolic (a model compiled for a range of sizes): the pixel tiles are then full, the
last of a row shifted back, one copy per tile width (``symbolic_width.py``).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import OneReduction, is_static, only_reduction
from ...targets.target_info import num_cores, spills_unrolled_loads, vector_lanes, vector_registers
from .helpers import (cpu_schedule, extent, inline_cheap_blocks, iter_kinds, one_reduction_kernel, pixel_tile,
                      schedule_pad, store_tile_epilogue, vectorized_init)
from .symbolic_width import schedule_by_width, schedule_static_width, static_except, width_tiles

# Output pixels per tile: with two channel blocks, 16 accumulators of AVX-512's 32 registers,
# leaving room for the weight vectors and the broadcast input (measured on resnet_tiny: 7-8
# beat 14 and 28, whose tiles spill). With one block (an odd number of them), twice as many
# pixels fill the same 16.
_MAX_ROW_TILE = 8
# A row no tile of at least this many pixels divides gets overlapping tiles instead (52
# columns take 6, overlapping: 62-64 % of the FMA peak, not 4: 57-59 %; 96 channels 3x3).
_MIN_EXACT_TILE = 5
# The same for one-block tiles: 52 columns take 13 pixels (60-64 %, 4 pixels 43 %), 20 take
# 10 (62 %, 5: 49-51 %; 3x3 convs, 48 channels).
_MIN_EXACT_TILE_ONE_BLOCK = 8
# On 16-register ISAs: independent accumulators that keep two FMA ports of 4-cycle latency busy.
_LATENCY_ACCUMULATORS = 8
_MAX_CHANNEL_BLOCKS = 4
# Tasks (output rows alone, or channel tiles alone) from which they balance over the cores
# (fewer: tasks are rows x channel tiles).
_MIN_TASKS = 6
# Filter values per input map value from which a conv's tasks are channel tiles over the whole
# map (resnet18 on Emerald Rapids, kernel alone: 3x3/2 256 -> 512 over 7x7, 18x the map,
# 631 -> 497 us; 3x3/2 128 -> 256 over 14x14, 2.6x, 425 -> 538 us).
_FILTERS_PER_MAP_VALUE = 4
# Input channels of a block unrolled together where LLVM's scheduling for the CPU spills a
# whole unrolled block's broadcasts (``spills_unrolled_loads``); elsewhere the whole block.
_SPILL_FREE_UNROLL = 4


class Conv2dNCHWc(ScheduleRule):
    """``[pad] -> conv2d_nchwc (S S S S S R R R R) -> elementwise..``, or the conv reading an
    NCHW map (``S S S S S R R R``, no input channel block)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        kernel = one_reduction_kernel(func, target)
        if kernel is None or not static_except(kernel.stmt, (2, 3)):
            return None
        read_ranks = sorted(len(read.source.shape) for read in kernel.stmt.reads)
        computed_map = read_ranks == [5, 5, 6] or any(
            read.source.dtype != kernel.stmt.writes[0].source.dtype for read in kernel.stmt.reads)
        if iter_kinds(kernel.stmt) == "SSSSSRRRR" and computed_map:
            # An SE scale or a dequantization inlined into the conv's loads costs a multiply or
            # a conversion per broadcast (half as many as the FMAs it feeds, or more): compute
            # each value once instead (``_schedule``).
            kernel = _map_apart(func, target)
            if kernel is None:
                return None
            read_ranks = sorted(len(read.source.shape) for read in kernel.stmt.reads)
        sch, stmt = kernel.sch, kernel.stmt
        if (iter_kinds(stmt), read_ranks) not in (("SSSSSRRRR", [5, 6]), ("SSSSSRRR", [4, 5])):
            return None  # a 5-D map and a 6-D blocked weight, or an NCHW map and OIHW[x]o weights
        lanes = vector_lanes(target, stmt.writes[0].source.dtype)
        loops = sch.get_loops(kernel.block)
        if extent(sch, loops[4]) > lanes or lanes % extent(sch, loops[4]):
            return None  # the channel block must fit one vector register
        registers, cores = vector_registers(target), num_cores(target)
        unroll = _SPILL_FREE_UNROLL if spills_unrolled_loads(target) else None
        height, width = (sch.get(loop).extent for loop in loops[2:4])
        # One output column (a 1-D conv exported as an Nx1 Conv2d): the tiles run down the rows.
        tiles_rows = is_static(width) and int(width) == 1 and is_static(height) and int(height) > 1
        if tiles_rows:
            width = height
        channel_blocks = extent(sch, loops[1])
        if is_static(width):
            width = int(width)
            window = extent(sch, loops[6]) * extent(sch, loops[7])  # (n, oc, y, x, ob, ic, ky, kx..)
            ow_tile, oc_tile = _register_tile(width, channel_blocks, registers, window)
            by_channel_tile = (not tiles_rows and _weights_outweigh_map(kernel.stmt)
                               and _shares_evenly(int(sch.get(loops[0]).extent) * channel_blocks // oc_tile, cores))
            return schedule_static_width(sch, width, ow_tile, lambda copy, tile: self._schedule(
                copy, tile, oc_tile, cores, unroll, tiles_rows, by_channel_tile))
        # Symbolic rows and columns: full tiles of pixels, the last of a row shifted back.
        return schedule_by_width(
            sch.mod["main"], width, width_tiles(_MAX_ROW_TILE, lanes),
            lambda copy, tile: self._schedule(copy, tile, _wide_register_tile(tile, channel_blocks, registers), cores,
                                              unroll))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, ow_tile: int, oc_tile: int, cores: int, unroll: int | None,
                  tiles_rows: bool = False, by_channel_tile: bool = False):
        """Tiles of ``ow_tile`` pixels x ``oc_tile`` channel blocks; returns the pixel-tile loop.
        ``unroll``: input channels of a block unrolled together (None: the whole block).
        ``by_channel_tile``: a task is a channel tile over the whole map, its filters read from
        memory once (``_weights_outweigh_map``)."""
        kernel = only_reduction(sch)
        conv = kernel.block
        n, oc, y, x, ob, *reduction = sch.get_loops(conv)  # (ic, ky, kx[, ib])
        if tiles_rows:
            y, x = x, y
        in_task = not by_channel_tile and _prologue_in_task(sch, kernel.prologue, (n, y, x), tiles_rows)
        if not in_task:
            schedule_pad(sch, kernel.prologue)
        oc_outer, oc_inner = sch.split(oc, [None, oc_tile])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        # With a pad or an SE scale, tasks are output rows, each padding (and SE-scaling) the
        # input rows it reads, in cache, for every channel tile of the row; not a pass over the
        # whole map first, which went through memory (kernel alone, 2 threads, AVX-512: 3x3/2
        # convs 32 -> 64 over 112x112 and 64 -> 128 over 28x28 45 -> 62 % of the FMA peak, 3x3
        # 64 -> 64 over 56x56 62 -> 68 %; mobilenetv3_tiny's SE projections 7-24 -> 2-7 us).
        # Rows that do not share out evenly over the cores (13 over 2) make tasks of (row,
        # channel tile), each preparing its input rows itself (Zen 1, 192 channels 3x3 over
        # 13x13, kernel alone: 1541 us as 13 row tasks, 1468 as 78 row x channel-tile tasks;
        # mobilenetv3_tiny's SE projections over 2-3 rows: 4.8-9.4 -> 3.1-6.8 us against a
        # pass of their own).
        # Either way a core's tasks are a band of rows, as in the kernels before and after it
        # (Injective's blocked maps too), so it mostly reads what it wrote itself (ddddocr-det
        # on Zen 1: the kernels' time in the model beyond their time alone 5.0 -> 3.0 ms).
        rows_alone = in_task and _shares_evenly(_row_count(sch, (n, y)), cores)
        if by_channel_tile:  # the rows inside a task, under its filters
            outer, task_loops = (n, oc_outer, y), (n, oc_outer)
        else:
            outer, task_loops = (n, y, oc_outer), ((n, y) if rows_alone else (n, y, oc_outer))
        sch.reorder(*outer, x_outer, *reduction, oc_inner, x_inner, ob)
        store_tile_epilogue(sch, conv, kernel.epilogue, x_outer)
        tasks = sch.fuse(*task_loops)
        sch.parallel(tasks)
        if in_task:
            for block in reversed(kernel.prologue):  # a pad before the scale it reads
                sch.compute_at(block, tasks)
                innermost = sch.get_loops(block)[-1]
                if extent(sch, innermost) == extent(sch, ob):  # a channel block (NCHW: a row)
                    sch.vectorize(innermost)
        sch.unroll(oc_inner)
        sch.unroll(x_inner)
        if len(reduction) == 4:
            # The input channels of one block, unrolled: the FMA loop runs without a branch per
            # input channel (2 threads, AVX-512, kernel alone: 96 -> 32 channels 3x3 over 160x160
            # 60 -> 65 % of the FMA peak, 16 -> 16 over 20x20 25 -> 38 %). Where the whole block
            # would spill (AMD Zen), four channels at a time.
            channels = reduction[3]
            if unroll is not None and extent(sch, channels) > unroll and extent(sch, channels) % unroll == 0:
                channels = sch.split(channels, [None, unroll])[1]
            sch.unroll(channels)
        sch.vectorize(ob)
        vectorized_init(sch, conv, reduction[0])
        return x_outer


def _map_apart(func: tirx.PrimFunc, target: Target) -> OneReduction | None:
    """``func`` with its cheap blocks inlined but the one that computes the conv's input map
    (an SE scale of the map by its gate, a quantized map's dequantization: the 5-D block the
    conv reads), which stays a block of its own: ``_schedule`` computes it once per value, not
    per FMA."""
    sch = cpu_schedule(func, target)
    kernel = only_reduction(sch)
    if kernel is None:
        return None
    read = {region.source for region in kernel.stmt.reads}
    maps = [block for block in kernel.prologue
            if len(sch.get(block).writes[0].source.shape) == 5 and sch.get(block).writes[0].source in read]
    if len(maps) != 1:
        return None
    inline_cheap_blocks(sch, keep=maps)
    return only_reduction(sch)


def _prologue_in_task(sch: s_tir.Schedule, prologue: list, loops: tuple, tiles_rows: bool) -> bool:
    """Whether the blocks before the conv (its pad, an SE scale) are computed inside each task:
    when there are any and the map is static (a symbolic one, or rows tiled down a column,
    keep a pass of their own)."""
    return bool(prologue) and not tiles_rows and all(is_static(sch.get(loop).extent) for loop in loops)


def _weights_outweigh_map(conv: tirx.SBlock) -> bool:
    """Whether the conv's filters (its read of highest rank) hold more than
    ``_FILTERS_PER_MAP_VALUE`` times the values of the map it reads (lowest rank): deep convs
    over small maps, ResNet's last stage. Tasks of output rows would each read every filter
    again, as many times as there are rows; tasks of channel tiles read each filter once and
    the small map from cache."""
    buffers = sorted((read.source for read in conv.reads), key=lambda buffer: len(buffer.shape))
    data, weight = buffers[0], buffers[-1]
    if not all(is_static(dim) for dim in (*data.shape, *weight.shape)):
        return False
    values = [math.prod(int(dim) for dim in buffer.shape) for buffer in (weight, data)]
    return values[0] > _FILTERS_PER_MAP_VALUE * values[1]


def _row_count(sch: s_tir.Schedule, loops: tuple) -> int:
    return math.prod(int(sch.get(loop).extent) for loop in loops)


def _shares_evenly(tasks: int, cores: int) -> bool:
    """Whether ``tasks`` equal tasks (rows, or channel tiles) keep the busiest core within 1/16
    of the mean."""
    return tasks >= _MIN_TASKS and -(-tasks // cores) * cores * 16 <= tasks * 17


def _register_tile(width: int, channel_blocks: int, registers: int, window: int) -> tuple[int, int]:
    """(pixels, channel blocks) of the accumulator tile at a static row width.

    32 registers (AVX-512): up to 8 pixels dividing the row (overlapping tiles when none of at
    least 5 does) x 2 channel blocks; with an odd number of blocks, a conv window wider than
    1x1 takes up to 16 pixels (8) x 1 block (a 1x1 conv's short reduction did not gain: 60-66 %
    at 10-14 pixels, 63-69 % at 7-8).

    16 registers (AVX2): the accumulators, one weight vector per block and the broadcast input
    must all fit (a 3x4 tile's 17 spill). Among those, the tile that is FMA-bound (at least one
    FMA per load: ``pixels * blocks >= pixels + blocks``) with enough accumulators to cover the
    FMA latency (two ports x 4 cycles) and the fewest columns an overlapping last tile
    recomputes; then the most accumulators. On Zen 3 3x4 and 4x3 tiles beat the 7x1 and 8x1
    ones by 1.2-1.5x. Kernel alone, 2 threads, Zen 1, 3x3 convs, 2x4 against 3x4: 96 channels
    over 13x13 371 against 401 us (4x2, recomputing 3 of the 13 columns: 425), 192 over 13x13
    1492 against 1561, 96 over 52x52 5200 against 5430.
    """
    if registers >= 32:
        if window == 1:
            three_or_five = _odd_blocks_tile(width, channel_blocks)
            if three_or_five:
                return three_or_five
        if channel_blocks % 2 and window > 1:
            return pixel_tile(width, 2 * _MAX_ROW_TILE, _MIN_EXACT_TILE_ONE_BLOCK), 1
        tile = pixel_tile(width, _MAX_ROW_TILE, _MIN_EXACT_TILE)
        return tile, _wide_register_tile(tile, channel_blocks, registers)

    def score(tile):
        pixels, blocks = tile
        computed = -(-width // pixels) * pixels
        fma_bound = min(1.0, pixels * blocks / (pixels + blocks))
        latency_covered = min(1.0, pixels * blocks / _LATENCY_ACCUMULATORS)
        return fma_bound * latency_covered * width / computed, pixels * blocks, pixels

    tiles = [(pixels, blocks) for pixels in range(1, min(width, _MAX_ROW_TILE) + 1)
             for blocks in range(1, _MAX_CHANNEL_BLOCKS + 1)
             if channel_blocks % blocks == 0 and pixels * blocks + blocks + 1 <= registers]
    return max(tiles, key=score)


def _odd_blocks_tile(width: int, channel_blocks: int) -> tuple[int, int] | None:
    """A 1x1 conv's tile of 3 or 5 channel blocks x 5-4 or 3 pixels (16 accumulators), for
    blocks an odd count of which 2 does not divide, and for an even count of 3s when the pixel
    tile divides the row exactly; None when neither 3 nor 5 divides the blocks.

    A 1x1 conv's reduction is short, so its pixel x 1-block tile loads a weight vector per
    8 FMAs and its pixels again per block; 5x3 loads 8 per 15. Kernel alone, 2 threads,
    AVX-512 (Emerald Rapids), against 8x1: ppocrv4-rec's 240 -> 240 over 12x80 554 -> 396 us
    (53 -> 75 % of the FMA peak), 144 -> 240 over 12x80 378 -> 239 us, ddddocr-det's 48-channel
    1x1s x1.24-1.43; against 4x2 on even blocks: ppocrv4-det's 96 channels over 160x160
    500 -> 400 us, rows of 20, 40 and 80 x1.05-1.25, but rows an overlapping tile covers (7,
    13, 14, 26 columns) 0.90-1.06, so those keep 4x2. 4x4 on powers of 2 did not gain (0.99)."""
    blocks = next((b for b in (3, 5) if channel_blocks % b == 0), None)
    if blocks is None:
        return None
    widest = 16 // blocks
    pixels = pixel_tile(width, widest, min(widest, _MIN_EXACT_TILE - 1))
    if channel_blocks % 2 or width % pixels == 0:
        return pixels, blocks
    return None


def _wide_register_tile(ow_tile: int, channel_blocks: int, registers: int) -> int:
    """Channel blocks per tile beside ``ow_tile`` pixels: 2 when they fit half the registers."""
    return 2 if channel_blocks % 2 == 0 and 2 * ow_tile <= registers // 2 else 1
