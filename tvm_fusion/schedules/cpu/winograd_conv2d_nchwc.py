"""A Winograd conv in NCHW[x]c (``kernels/winograd_conv2d.py``) + fused epilogue, in one pass
over the map.

A task is a row of output tiles (or a band of it, so that its transformed input stays in
L2). It transforms the input tiles of its band, all channels, once; then for each chunk of
output channel blocks it computes the (m+2)^2 matrix products of those tiles by the chunk's
transformed weights, on a register tile of ``tiles`` x ``chunk`` vectors (one broadcast
input value per ``chunk`` weight vectors, as in the direct conv's tile), and turns them into
the chunk's output tiles, the epilogue applied before the store. The transformed input and
the products never leave the task's cache; only the map, the transformed weights and the
output go through memory.

Kernel alone, 2 threads, Zen 1, 3x3 convs + bias + SiLU, F(4x4), against the direct conv's
schedule (Conv2dNCHWc), timed interleaved in one process: 48 -> 192 channels over 16x64
4373 -> 2014 us, 64 -> 256 over 8x32 2654 -> 1045, 96 -> 96 over 52x52 6711 -> 2757, 64 -> 64
over 80x80 10924 -> 4871 (2.2-2.5x; ddddocr-ocr's and the YOLOX detector's shapes).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.winograd_conv2d import (WINOGRAD_GEMM, WINOGRAD_INPUT, WINOGRAD_INPUT_ROWS, WINOGRAD_OUTPUT,
                                        WINOGRAD_OUTPUT_ROWS, WINOGRAD_STAGES, WINOGRAD_WEIGHT, is_winograd_block)
from ...targets.target_info import num_cores, vector_registers
from .helpers import cpu_schedule, extent, store_tile_epilogue, vectorized_init

# The transformed input a task keeps for its band of tiles: half of Zen 1's 512 KiB L2 (the
# products of one channel chunk and the weights streaming through take the rest).
_BAND_BYTES = 256 * 1024
# Tiles per register tile: at most this many, and as many as leave registers for the weight
# vectors and the broadcast input.
_MAX_TILES = 8
_LATENCY_ACCUMULATORS = 8


class WinogradConv2dNCHWc(ScheduleRule):
    """``[pad] -> [winograd_weight] -> winograd_input_rows -> winograd_input -> winograd_gemm ->
    winograd_output_rows -> winograd_output -> elementwise..``, every extent static."""

    # Asked first, before every other rule: it knows a Winograd kernel by its block names, while
    # the others inline a kernel's cheap blocks before declining it, which on these kernels (the
    # pad into the input transform) cost nudenet's numeric gate 38 of its 59 s.
    runs_before = ("*",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        if sch is None:
            return None
        blocks = list(sch.get_child_blocks(get_root_block(sch)))
        names = [sch.get(block).name_hint for block in blocks]
        positions = {}
        for stage in WINOGRAD_STAGES:
            found = [i for i, name in enumerate(names) if is_winograd_block(name, stage)]
            if len(found) > 1 or (not found and stage != WINOGRAD_WEIGHT):
                return None
            positions[stage] = found[0] if found else None
        weight = positions[WINOGRAD_WEIGHT]
        before = [blocks[i] for i in range(positions[WINOGRAD_INPUT_ROWS]) if i != weight]
        epilogue = blocks[positions[WINOGRAD_OUTPUT] + 1:]
        stages = {stage: blocks[i] for stage, i in positions.items() if i is not None}
        try:
            for block in [*before, *epilogue[:-1]]:  # pads (and an input scale) into the input transform
                sch.compute_inline(block)
        except s_tir.ScheduleError:
            return None
        if weight is not None:
            _schedule_weight_transform(sch, blocks[weight])
        _schedule_tiles(sch, stages, epilogue[-1] if epilogue else None, vector_registers(target), num_cores(target))
        return sch


def _schedule_tiles(sch: s_tir.Schedule, stages: dict, store, registers: int, cores: int) -> None:
    transform, gemm, output = stages[WINOGRAD_INPUT], stages[WINOGRAD_GEMM], stages[WINOGRAD_OUTPUT]
    points, _, batch, tile_rows, tile_columns, in_chunks, in_block = (
        int(dim) for dim in sch.get(transform).writes[0].source.shape)
    tile = points - 2
    out_chunks = extent(sch, sch.get_loops(output)[1])
    chunk = 2 if out_chunks % 2 == 0 else 1
    band = _band(tile_columns, points * points * in_chunks * in_block * 4)
    tiles = _register_tiles(band, chunk, registers)

    n, oc, y, x, ob = sch.get_loops(output)
    ty, a = sch.split(y, [None, tile])
    tx, b = sch.split(x, [None, tile])
    bands, tx = sch.split(tx, [None, band])
    oc_outer, oc_inner = sch.split(oc, [None, chunk])
    # Rows of tiles are the tasks when they share out evenly; else a task is a row's chunk of
    # output channels, each transforming its input tiles itself.
    rows_alone = (batch * tile_rows) % cores == 0 or batch * tile_rows >= 4 * cores
    if rows_alone:
        sch.reorder(n, ty, bands, oc_outer, tx, oc_inner, a, b, ob)
        task, products_at = sch.fuse(n, ty), oc_outer
    else:
        sch.reorder(n, ty, oc_outer, bands, tx, oc_inner, a, b, ob)
        task, products_at = sch.fuse(n, ty, oc_outer), bands
    sch.parallel(task)
    if store is not None:
        sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(store)[-1])
    for loop in (oc_inner, a, b):
        sch.unroll(loop)  # the points' selects fold to their own sums
    sch.vectorize(ob)
    _transform_at(sch, stages[WINOGRAD_OUTPUT_ROWS], a)  # one output row: 6 vectors

    sch.compute_at(gemm, products_at, preserve_unit_loops=True)
    e1, e2, _, _, gtx, goc, gob, ic, ib = sch.get_loops(gemm)[-9:]
    tx_outer, tx_inner = sch.split(gtx, [None, tiles])
    sch.reorder(e1, e2, tx_outer, ic, ib, tx_inner, goc, gob)
    store_tile_epilogue(sch, gemm, [], tx_outer)
    for loop in (tx_inner, goc):  # ib stays a loop: unrolled, 1.2-1.7x slower (Zen 1)
        sch.unroll(loop)
    sch.vectorize(gob)
    vectorized_init(sch, gemm, ic)

    sch.compute_at(transform, bands, preserve_unit_loops=True)
    e1, e2, _, _, vtx, vic, vib = sch.get_loops(transform)[-7:]
    sch.reorder(vtx, vic, e1, e2, vib)
    sch.unroll(e1)
    sch.unroll(e2)
    sch.vectorize(vib)
    _transform_at(sch, stages[WINOGRAD_INPUT_ROWS], e1)  # one row of B^T d: 6 vectors


def _transform_at(sch: s_tir.Schedule, block, loop) -> None:
    """A first-pass transform (``B^T d``, ``A^T M``) one row at a time under ``loop``, the
    row's points unrolled and its channel block one vector."""
    sch.compute_at(block, loop, preserve_unit_loops=True)
    loops = sch.get_loops(block)
    sch.unroll(loops[-6])
    sch.vectorize(loops[-1])


def _schedule_weight_transform(sch: s_tir.Schedule, block) -> None:
    """A weight computed at run time: transformed per channel pair, its points unrolled."""
    e1, e2, oc, ic, ib, ob = sch.get_loops(block)
    sch.reorder(oc, ic, ib, e1, e2, ob)
    sch.parallel(oc)
    sch.unroll(e1)
    sch.unroll(e2)
    sch.vectorize(ob)


def _band(tile_columns: int, bytes_per_tile: int) -> int:
    """Tiles of a row per task: the most that divide the row and whose transformed input fits
    ``_BAND_BYTES`` (1 when none does)."""
    fitting = [d for d in range(1, tile_columns + 1) if tile_columns % d == 0 and d * bytes_per_tile <= _BAND_BYTES]
    return max(fitting, default=1)


def _register_tiles(band: int, chunk: int, registers: int) -> int:
    """Tiles per register tile, among those whose accumulators, weight vectors and broadcast
    fit the registers: the most useful work, the share of real tiles computed times the share
    of the FMA latency the accumulators cover (two ports x 4 cycles); then the widest."""
    widest = max(1, min(_MAX_TILES, (registers - chunk - 1) // chunk, band))

    def score(tiles: int) -> tuple[float, int]:
        computed = -(-band // tiles) * tiles
        return band / computed * min(1.0, tiles * chunk / _LATENCY_ACCUMULATORS), tiles

    return max(range(1, widest + 1), key=score)
