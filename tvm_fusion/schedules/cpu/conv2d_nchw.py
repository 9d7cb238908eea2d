"""Register-blocked direct NCHW convolution with its epilogue computed inside each output tile.

The accumulator tile is ``oc_tile`` output channels x ``ow_tile`` output columns: for every
(input channel, kh, kw) one vector of input columns is loaded and multiplied by ``oc_tile``
broadcast weights, so each load feeds ``oc_tile`` FMAs (the same reuse NCHWc kernels get from
their channel block, without layout transforms around every conv). Bias, activations, the
residual add and an SE input scale run on the tile before it is stored.

On a large map each input channel's rows sit on pages of their own, and a tile that walks all
input channels at once streams from hundreds of pages. There the input channels are taken in
chunks (``_MAX_STREAMS`` rows at a time) with a whole output row of accumulators kept in cache
between chunks, the epilogue run once per row (a 96 -> 24 channel 3x3 conv over 160x160 on
Zen 3: 21 -> 9 ms at best, 25-27 -> 14-18 ms on a busy machine).
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_static
from ...targets.target_info import num_cores, vector_registers
from .helpers import (compute_epilogue_at, extent, largest_divisor, schedule_pad, store_tile_epilogue,
                      vectorize_innermost, vectorized_init)
from .matchers import ConvBlocks, conv_kernel, schedule_conv_tiles, split_column_phases, splits_column_phases
from .symbolic_width import mentions, without_predicates_on

# 16 accumulator vectors + input vector + broadcasts fit AVX-512's 32 registers; AVX2's 16
# leave room for 12 (Zen 3, kernel alone, best of 60 runs, two runs each: a 64-channel 3x3 conv
# over 56x56 took 2.6-2.9 ms with 12, 3.5-3.7 ms with 16). At two vectors of columns per tile,
# half as many channels.
_MAX_ACCUMULATORS = 16
_REGISTERS_KEPT_FREE = 4
# A conv's tile takes several output rows (at least 2) where the accumulators hold at least 4 of
# a row's tiles (``_row_tile``).
_MIN_ROW_TILES = 4
_MIN_ROWS_PER_TILE = 2
# Input rows one pass over the reduction streams from, and the channel plane from which on
# each channel's rows are pages apart.
_MAX_STREAMS = 48
_PAGE_BYTES = 4096
# Input maps up to this size may have their pixels tiled as one row (``_pixels_flatten``):
# every channel tile's task reads the whole map, which stays in L2 (the smallest seen: Zen 1's
# 512 KiB); a larger map keeps its rows as tasks, each reading its own rows.
_FLAT_MAP_BYTES = 512 * 1024


class Conv2dNCHW(ScheduleRule):
    """Dense and grouped NCHW conv2d (any stride, padding, dilation) + fused epilogue."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = conv_kernel(func, target, depthwise=False)
        if found is None:
            return None
        sch, blocks, lanes = found
        accumulators = min(_MAX_ACCUMULATORS, vector_registers(target) - _REGISTERS_KEPT_FREE)
        if _pixels_flatten(sch, blocks, lanes, accumulators // 2, num_cores(target)):
            _flatten_pixels(sch, blocks)
        # A strided conv gathers its input vectors: one vector of columns and twice the
        # channels gets each gathered vector twice the FMAs (measured 1.2-1.4x on 3x3/2 convs
        # with 160-320 output columns). A stride-2 conv over a padded map reads contiguous
        # vectors once the map's even and odd columns are stored apart.
        contiguous = blocks.column_stride == 1 or splits_column_phases(sch, blocks)
        max_vectors = 2 if contiguous else 1
        overlaps = []  # (channel-tile loop variable, tile, channels) where the last tile shifts back
        scheduled = schedule_conv_tiles(func, sch, blocks, lanes, max_vectors, lambda copy, copy_blocks, tile:
                                        self._schedule(copy, copy_blocks, tile, lanes, accumulators, overlaps))
        if scheduled is None or not overlaps:
            return scheduled
        shifted = _overlap_last_channel_tile(scheduled.mod["main"], *overlaps[0])
        # Not found: the split's predicates stay (correct, only slower).
        return scheduled if shifted is None else s_tir.Schedule(shifted)

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int, lanes: int, accumulators: int,
                  overlaps: list):
        """Tiles of ``oc_tile`` channels x ``ow_tile`` columns; returns the column-tile loop."""
        split_column_phases(sch, blocks)
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = blocks.tiled_loops(sch.get_loops(blocks.conv))
        chunk = _channel_chunk(sch, blocks, rc, ry, x, ow_tile)
        vectors = -(-ow_tile // lanes)
        channels = extent(sch, f)
        oc_tile = largest_divisor(channels, accumulators // vectors)
        overlap = (chunk is None and bool(blocks.epilogue) and isinstance(extent(sch, x), int)
                   and _shifted_channel_tile(channels, accumulators // vectors, oc_tile))
        if overlap:
            oc_tile = overlap
        f_outer, f_inner = sch.split(f, [None, oc_tile])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        if chunk is None:
            tile = [f_inner, x_inner]
            oh_tile = 1 if overlap or blocks.tiles_rows else _row_tile(sch, y, accumulators // (oc_tile * vectors))
            if oh_tile > 1:  # few output channels: rows of the tile keep the FMAs' chains apart
                y, y_inner = sch.split(y, [None, oh_tile])
                sch.unroll(y_inner)
                tile = [f_inner, y_inner, x_inner]
            sch.reorder(n, f_outer, y, x_outer, rc, ry, rx, *tile)
            store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
            init_at = rc
        else:  # a row of accumulators in cache, the input channels in chunks
            init_at, rc_inner = sch.split(rc, [None, chunk])
            sch.reorder(n, f_outer, y, init_at, x_outer, rc_inner, ry, rx, f_inner, x_inner)
            vectorize_innermost(sch, compute_epilogue_at(sch, blocks.conv, blocks.epilogue, y), y, lanes)
        rows = sch.fuse(n, f_outer, y)
        sch.parallel(rows)
        if overlap:
            overlaps.append((sch.get(rows).loop_var, oc_tile, channels))
        sch.unroll(f_inner)
        sch.vectorize(x_inner)
        # The init splits out only after the loops above are final (parallel refuses a loop
        # over a reduction's separate init).
        if chunk is None:
            vectorized_init(sch, blocks.conv, init_at)
        else:
            vectorize_innermost(sch, sch.decompose_reduction(blocks.conv, init_at), rows, lanes)
        return x_outer


def _row_tile(sch: s_tir.Schedule, rows, row_tiles: int) -> int:
    """Output rows per tile for a conv of so few output channels that a row's tile takes at
    most a quarter of the accumulators (a 1-channel head: 2 vectors of columns, each FMA
    waiting on the one before): the largest divisor of the rows up to ``row_tiles`` (the tiles
    of a row the accumulators hold), once it is at least 2; else 1. The rows' chains of FMAs
    then run side by side."""
    height = extent(sch, rows)
    if not isinstance(height, int) or row_tiles < _MIN_ROW_TILES:
        return 1
    tile = largest_divisor(height, row_tiles)
    return tile if tile >= _MIN_ROWS_PER_TILE else 1


def _pixels_flatten(sch: s_tir.Schedule, blocks: ConvBlocks, lanes: int, channel_tile: int, cores: int) -> bool:
    """A 1x1 unit-stride conv without pad over a static map (up to ``_FLAT_MAP_BYTES``) whose
    rows are not whole vectors (ShuffleNet's 14x14 and 7x7 maps: 14 and 7 of 16 lanes used),
    with an epilogue on the same pixels (without one, the tile's store would be placed by the
    unflattened output's rows), with enough channel tiles to share out (at least two
    tasks a core: the rows of the map are gone as tasks). Its pixels are then one row of
    H x W, contiguous in every map as the columns of one row are (kernel alone, 2 threads,
    same process, rows against one row: 232 -> 232 channels over 7x7 132 -> 82 us, 464 -> 1024
    over 7x7 1245 -> 778 us, 58 -> 58 over 28x28 111 -> 83 us, 116 -> 116 over 14x14 98 ->
    96 us)."""
    conv = sch.get(blocks.conv)
    n, f, rows, columns, channels_in, window_rows, window_columns = (int(iv.dom.extent) if is_static(iv.dom.extent)
                                                                   else None for iv in conv.iter_vars)
    if (not blocks.epilogue or blocks.pad or blocks.tiles_rows or blocks.column_stride != 1
            or None in (n, f, rows, columns) or (window_rows, window_columns) != (1, 1)
            or rows == 1 or columns % lanes == 0):
        return False
    batch = conv.iter_vars[0].var
    maps = [read.source for read in conv.reads if len(read.source.shape) == 4 and read.region[0].min.same_as(batch)
            and all(is_static(d) for d in read.source.shape)]
    if not maps or any([int(d) for d in source.shape[2:]] != [rows, columns] for source in maps):
        return False  # strided: the output map is smaller than the input's
    if channels_in * rows * columns * maps[0].dtype.bits // 8 > _FLAT_MAP_BYTES:
        return False
    domain = [n, f, rows, columns]
    for block in blocks.epilogue:
        ivs = sch.get(block).iter_vars
        if len(ivs) != 4 or [int(iv.dom.extent) if is_static(iv.dom.extent) else None for iv in ivs] != domain:
            return False
    return n * -(-f // channel_tile) >= 2 * cores


def _flatten_pixels(sch: s_tir.Schedule, blocks: ConvBlocks) -> None:
    """The conv and its epilogue over ``(n, f, 1, rows x columns)`` (``_pixels_flatten``): the
    tiles then run along all the map's pixels as along one row."""
    columns = int(sch.get(blocks.conv).iter_vars[3].dom.extent)
    sch.transform_layout(blocks.conv, ("write", 0), lambda n, c, y, x: (n, c, y * 0, y * columns + x))
    sch.transform_block_layout(blocks.conv, lambda n, f, y, x, rc, ry, rx: (n, f, y * 0, y * columns + x, rc, ry, rx))
    for block in blocks.epilogue:
        sch.transform_block_layout(block, lambda n, f, y, x: (n, f, y * 0, y * columns + x))


def _shifted_channel_tile(channels: int, widest: int, divisor: int) -> int | None:
    """The widest channel tile, its last tile shifted back to end at the last channel, when no
    divisor of ``channels`` comes close (ShuffleNet's 58, 116 and 232 channels: 2, 4 and 8 of
    16) and the channels computed twice stay under an eighth; None to keep the divisor."""
    if divisor >= widest or channels <= widest or -channels % widest * 8 > channels:
        return None
    return widest


def _overlap_last_channel_tile(func: tirx.PrimFunc, rows: tirx.Var, tile: int, channels: int) -> tirx.PrimFunc | None:
    """``func`` with each channel tile starting at ``min(start, channels - tile)``.

    The tile's first channel is ``(task index expression) * tile`` in every block of the tile
    (init, conv, epilogue); the split's predicates on the tasks are dropped, as every tile now
    lies inside the channels. The channels of the last tile that the one before computed too
    are computed again with the same values; each task accumulates in its own tile (the
    epilogue reads the tile, so the conv's buffer is compacted to it), so the overlap races
    on no partial sum. None when no tile start is found."""
    starts = []

    def shifted(mul):
        if isinstance(mul.b, tirx.IntImm) and int(mul.b) == tile and mentions(mul.a, rows):
            starts.append(mul)
            return tirx.Min(mul, tirx.IntImm(mul.b.ty.dtype, channels - tile))
        return mul

    body = tvm_ffi.structural_map(without_predicates_on(func.body, rows), [(tirx.Mul, shifted)])
    return func.with_body(body) if starts else None


def _channel_chunk(sch: s_tir.Schedule, blocks: ConvBlocks, rc, ry, x, ow_tile: int) -> int | None:
    """Input channels per pass over a row when one pass over all of them would stream from more
    than ``_MAX_STREAMS`` input rows, each channel on pages of its own; None to take them all
    at once (small maps, few channels, or tiles overlapping at the row's end, whose columns
    must not be accumulated twice)."""
    channels, rows, width = extent(sch, rc), extent(sch, ry), extent(sch, x)
    if not all(isinstance(v, int) for v in (channels, rows, width)) or width % ow_tile:
        return None
    # The feature map (padded, its columns maybe split in phases) is the read with the largest
    # channel plane; the weight's is kh x kw.
    planes = [math.prod(int(d) for d in read.source.shape[2:]) * read.source.dtype.bits // 8
              for read in sch.get(blocks.conv).reads if all(is_static(d) for d in read.source.shape[2:])]
    if not planes or max(planes) < _PAGE_BYTES:
        return None
    if channels * rows <= _MAX_STREAMS:
        return None
    chunk = largest_divisor(channels, max(_MAX_STREAMS // rows, 1))
    return chunk if chunk < channels else None

