"""AMX tile kernels for the packed-weight matmuls: shared by ``Int8MatmulAmx`` (``tdpbusd``,
uint8 x int8 -> int32) and ``Bf16MatmulAmx`` (``tdpbf16ps``, bf16 x bf16 -> float32). The
tensor intrinsics (a call's tiles over all of K) are ``amx_intrinsics.py``'s.

An AMX tile is up to 16 rows of 64 bytes. One product instruction adds, to each 4-byte
accumulator of a 16 x 16 C tile, the products of 16 groups of ``depth_block`` consecutive k
(4 int8, 2 bf16): A holds 16 rows x 64 bytes of the activation (row-major, as it is in
memory), B 16 groups x 16 columns, which is the kernel's packed weight ``[N/16, K/d, 16, d]``
as it is (``W[j, 16q:16q+16]`` is 16 rows of 64 contiguous bytes).

Each output tile is one call of a tensor intrinsic that covers the whole of K: it configures
the tiles (when they hold another configuration), zeroes the C tiles, runs the K loop and
stores them into a local accumulator; the epilogue then runs on the tile. A call is 2 x 2 (two
row tiles by 32 columns: ``square_rows``) where K is whole tiles and M has two row tiles of 8
or more, else 1 x 4 (one row tile by up to 64 columns, ``blocks`` C tiles side by side); the
2 x 2 call reads half the weight bytes per row, which bounds a call in L2. The intrinsic is
registered per (rows, blocks, K): all three are shapes in its configuration.

Linux hands a process the AMX state only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, one permission for every AMX product), else the first tile instruction
kills it (SIGILL): an exported library requests it when loaded (``targets/amx_permission.cc``),
and ``schedule_tiles`` requests it for the compiling process (``targets.amx.request_amx_permission``).

Rows are tiled by the largest divisor of M up to 16; where M is past 16 and that is below
``MIN_TILE_ROWS`` (a prime M such as 197) the sum is computed as copies (``loop_partition``):
tiles of 16 rows, then one tile of the rest, the epilogue after the whole sum.
``schedule_tiles`` declines for a symbolic row count, below the product's ``min_rows`` (int8:
``MIN_TILE_ROWS``, as a tile costs more than it computes against ``vpdpbusd`` there; bf16: 1,
as it has no register kernel), and for a batched sum with such a prime M (TVM's blockize binds
the batch loop outside the copies as 0).
"""

from __future__ import annotations

from math import prod

from tvm import s_tir

from ...frontend.packed_weights import COLUMN_BLOCK
from ...kernels.blocks import OneReduction
from ...targets.amx import request_amx_permission
from .amx_copies import normalized_copies
from .amx_intrinsics import TILE_ROWS, TileProduct, register_amx_intrins
from .helpers import extent_of, largest_divisor
from .int8_sum import operand_block, place_prologue, with_epilogue_per_tile, write_back_tiles

# C tiles side by side per 1 x 4 call (of the 8 tile registers: C tiles, A, B, and A, B for K's tail).
MAX_BLOCKS = 4
# Rows of each of a 2 x 2 call's two row tiles at least (``square_rows``); below it, 1 x 4 calls.
MIN_SQUARE_TILE_ROWS = 8
# Rows of a tile at least past 16 rows (a divisor of M, else tiles of 16 and a tail); the int8
# tiles' min_rows: below it the VNNI kernel was the faster one (a tile's configuration and loads
# cost more than a few rows gain).
MIN_TILE_ROWS = 5
# A weight larger than this is swept once per tile of columns, all rows under it, instead of
# once per tile of rows: it no longer stays in L2 between row tiles.
COLUMNS_OUTER_WEIGHT_BYTES = 1 << 20


def schedule_tiles(kernel: OneReduction, spec: TileProduct, operand_per_row_tile: bool = False
                   ) -> s_tir.Schedule | None:
    """``kernel`` (a packed-weight sum of ``spec``'s form) as AMX tiles, its element-wise
    epilogue per tile where it can follow one; None where tiles do not pay or cannot be formed.
    With ``operand_per_row_tile`` the prologue that writes the A operand (a conv's patch rows)
    is computed per tile of rows, where there are enough of them to share among cores
    (``int8_sum.operand_block``)."""
    *batch, m, _, _ = kernel.stmt.iter_vars
    rows = extent_of(m.dom.extent)
    if not isinstance(rows, int) or rows < spec.min_rows:
        return None
    tile_rows = largest_divisor(rows, TILE_ROWS)
    partitioned = tile_rows < MIN_TILE_ROWS and rows > TILE_ROWS
    if partitioned and batch:
        return None  # blockize binds a batch loop outside loop_partition's copies as 0: wrong sums
    sch = kernel.sch
    row_tiles = rows // tile_rows * prod(extent_of(iv.dom.extent) for iv in batch)
    operand = operand_block(kernel, row_tiles) if operand_per_row_tile else None
    place_prologue(sch, kernel)
    if partitioned:  # 197 rows: 12 tiles of 16, one of 5
        try:
            scheduled = _schedule_with_row_tail(sch, kernel.block, kernel.epilogue, spec)
        except s_tir.ScheduleError:
            return None
        request_amx_permission()
        return scheduled
    scheduled = with_epilogue_per_tile(sch, lambda attempt, epilogue_per_tile: _schedule(
        attempt, kernel.block, kernel.epilogue, tile_rows, epilogue_per_tile, spec, operand))
    if scheduled is not None:
        request_amx_permission()  # this process may run the kernel (compile's verification)
    return scheduled


def _columns_outer(spec: TileProduct, columns: int, depth: int) -> bool:
    return columns * depth * spec.operand_bytes > COLUMNS_OUTER_WEIGHT_BYTES


def _schedule(sch: s_tir.Schedule, block, epilogue: list, tile_rows: int, per_tile: bool, spec: TileProduct,
              operand=None) -> None:
    """One AMX call per output tile of ``tile_rows`` (a divisor of M) x up to 64 columns; the
    epilogue computed per tile, or (``per_tile`` False) after the whole sum, across cores; the
    ``operand`` block (None: left as it is) computed per tile of rows, the column tiles under it."""
    *batch, m, n, k = sch.get_loops(block)
    rows, columns, depth = (extent_of(sch.get(loop).extent) for loop in (m, n, k))
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    square = square_rows(spec, rows, columns, depth)
    row_tiles, tall = tall_rows(spec, rows, columns, depth) if not square else (1, 0)
    if square:
        tile_rows, blocks = square, 2
    elif tall:
        tile_rows = tall
    m_outer, m_inner = sch.split(m, [None, tile_rows])
    n_outer, n_inner = sch.split(n, [None, blocks * COLUMN_BLOCK])
    outer = (n_outer, m_outer) if operand is None and _columns_outer(spec, columns, depth) else (m_outer, n_outer)
    sch.reorder(*outer, m_inner, n_inner, k)
    write_back_tiles(sch, block, batch, outer, epilogue, per_tile, operand)
    init = sch.decompose_reduction(block, m_inner)
    init_intrin, intrin = register_amx_intrins(spec, tile_rows, blocks, depth, square=bool(square),
                                               row_tiles=row_tiles)
    if tile_rows == 1:  # a unit row loop leaves no row axis in the blocks: the tile starts at the columns
        sch.tensorize(sch.get_loops(init)[-1], init_intrin)
        sch.tensorize(n_inner, intrin)
    else:
        sch.tensorize(sch.get_loops(init)[-2], init_intrin)
        sch.tensorize(m_inner, intrin)


def square_rows(spec: TileProduct, rows: int, columns: int, depth: int) -> int:
    """The rows of a 2 x 2 call (two row tiles, 32 columns) for this sum, or 0 where 1 x 4 calls
    take it: K in whole tiles, whole pairs of column blocks, and two row tiles of at least
    ``MIN_SQUARE_TILE_ROWS`` rows that divide M (the most rows there are)."""
    if depth % spec.depth_per_tile or columns % (2 * COLUMN_BLOCK):
        return 0
    tile = max((t for t in range(MIN_SQUARE_TILE_ROWS, TILE_ROWS + 1) if rows % (2 * t) == 0), default=0)
    return 2 * tile


def tall_rows(spec: TileProduct, rows: int, columns: int, depth: int) -> tuple[int, int]:
    """(R, rows) of an R x 1 call for a sum of one column block, or (1, 0) where 1 x 4 calls take
    it: K in whole tiles, and R row tiles (2 to ``MAX_BLOCKS``) of at least
    ``MIN_SQUARE_TILE_ROWS`` rows that divide M, the most rows per call, then the fullest tiles
    (a 264-pixel output row: 4 tiles of 11; 48 rows: 3 of 16)."""
    if depth % spec.depth_per_tile or columns != COLUMN_BLOCK:
        return 1, 0
    shapes = [(r * t, t, r) for r in range(2, MAX_BLOCKS + 1) for t in range(MIN_SQUARE_TILE_ROWS, TILE_ROWS + 1)
              if rows % (r * t) == 0]
    if not shapes:
        return 1, 0
    call_rows, _, row_tiles = max(shapes)
    return row_tiles, call_rows


def row_partitions(rows: int) -> list[tuple[int, int]]:
    """(rows, tile rows) of each copy of the sum: tiles of 16, then one tile of the rest; a
    rest of 1 row (which blockize does not take as a tile) joins the last 16 as tiles of 8 and 9."""
    tail = rows % TILE_ROWS
    if tail != 1:
        return [(rows - tail, TILE_ROWS), (tail, tail)]
    return ([(rows - 17, TILE_ROWS)] if rows > 17 else []) + [(8, 8), (9, 9)]


def _schedule_with_row_tail(sch: s_tir.Schedule, block, epilogue: list, spec: TileProduct) -> s_tir.Schedule:
    """M with no divisor that fills a tile (a prime M past 16): the sum as copies
    (``loop_partition``, ``row_partitions``), tiles of 16 rows over the first ``M - M % 16``
    rows and one tile of the rest, written whole into memory; then the epilogue in one pass
    over it, across cores. (The per-tile epilogue of ``_schedule`` would need one tile loop
    for all copies.)"""
    *_, m, n, k = sch.get_loops(block)
    rows, columns, depth = (extent_of(sch.get(loop).extent) for loop in (m, n, k))
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    partitions = row_partitions(rows)
    epilogue_names = [sch.get(block_rv).name_hint for block_rv in epilogue]
    parts = sch.loop_partition(m, [extent for extent, _ in partitions[:-1]] + [None])
    copies = [sch.get(sch.get_child_blocks(part)[0]).name_hint for part in parts]
    sch = s_tir.Schedule(normalized_copies(sch.mod["main"], copies))
    for name, (extent, tile_rows) in zip(copies, partitions):
        copy = sch.get_sblock(name)
        m_part, n_part, k_part = sch.get_loops(copy)[-3:]
        n_outer, n_inner = sch.split(n_part, [None, blocks * COLUMN_BLOCK])
        if extent > tile_rows:
            m_outer, m_inner = sch.split(m_part, [None, tile_rows])
            outer = (n_outer, m_outer) if _columns_outer(spec, columns, depth) else (m_outer, n_outer)
            sch.reorder(*outer, m_inner, n_inner, k_part)
            sch.parallel(sch.fuse(*outer))
        else:  # one tile
            m_inner = m_part
            sch.reorder(n_outer, m_inner, n_inner, k_part)
            sch.parallel(n_outer)
        init = sch.decompose_reduction(copy, m_inner)
        init_intrin, intrin = register_amx_intrins(spec, tile_rows, blocks, depth, "global")
        sch.tensorize(sch.get_loops(init)[-2], init_intrin)
        sch.tensorize(m_inner, intrin)
    if epilogue_names:  # all but the last epilogue block inlined into the last
        *inlined, output = [sch.get_sblock(name) for name in epilogue_names]
        for block_rv in inlined:
            sch.compute_inline(block_rv)
        *outer, inner = sch.get_loops(output)
        if outer:
            sch.parallel(sch.fuse(*outer))
        sch.vectorize(inner)
    return sch
