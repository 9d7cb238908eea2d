"""The loop structure a schedule rule produced, so a test can check what the rule promises
(rows across cores, vectors of the target's width, tile sizes) and not only that the numbers
still match: a rule that returned its input unchanged would pass a numbers-only test."""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.tirx import ForKind

from tvm_fusion.schedules.cpu.small_extent import MAX_SERIAL_STATIC_WORK
from tvm_fusion.targets.target_info import simd_bits


@dataclasses.dataclass
class LoopKinds:
    """Extents of the scheduled function's annotated loops, in walk order."""

    parallel: list[int]
    vectorized: list[int]
    unrolled: list[int]
    serial: list[int]


def loop_kinds(func: tvm.tirx.PrimFunc) -> LoopKinds:
    """Walk ``func`` and collect the extents of its parallel, vectorized, unrolled and serial
    loops (those of static extent)."""
    found: dict[int, list[int]] = {ForKind.PARALLEL: [], ForKind.VECTORIZED: [], ForKind.UNROLLED: [],
                                   ForKind.SERIAL: []}

    def visit(loop: tvm.tirx.For) -> None:
        if loop.kind in found and isinstance(loop.extent, tvm.tirx.IntImm):
            found[loop.kind].append(int(loop.extent))

    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, visit))
    return LoopKinds(found[ForKind.PARALLEL], found[ForKind.VECTORIZED], found[ForKind.UNROLLED],
                     found[ForKind.SERIAL])


def blocks_in(func) -> set[str]:
    """Names of the blocks in ``func`` (a PrimFunc or any statement), the root left out."""
    names = set()
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda block: names.add(block.name_hint)))
    return names - {"root"}


def blocks_under_parallel_loop(func) -> set[str]:
    """Names of the blocks inside ``func``'s one parallel loop: all of them when each task
    prepares its own inputs (no pass of its own before the tasks)."""
    loops = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, loops.append))
    (parallel,) = [loop for loop in loops if loop.kind == tvm.tirx.ForKind.PARALLEL]
    return blocks_in(parallel)


def float_lanes(target: tvm.target.Target) -> int:
    """float32 lanes in one vector register of ``target``: 8 on AVX2, 16 on AVX-512."""
    return simd_bits(target) // 32


def matmul_tile_rows(lanes: int) -> int:
    """Rows per matmul register tile of two float32 vectors on x86: 8 with AVX-512's 32 vector
    registers, 6 with AVX2's 16 (6 x 2 accumulators, two B vectors and an A broadcast)."""
    return 8 if lanes >= 16 else 6


def matmul_column_tile(n: int, lanes: int) -> tuple[int, int]:
    """(columns per tile, vector width of the update) of the matmul rules over ``n`` columns:
    up to two whole vectors; else, where a power of two of at least 4 lanes divides ``n``, up
    to 3 such narrower vectors on AVX-512 (2 on AVX2) unrolled, each a register; else a
    divisor of ``n`` as one vector."""
    exact = whole_vectors(n, lanes, 2)
    if exact:
        return exact, exact
    width = max(w for w in (1, 2, 4, 8, 16) if w <= lanes and n % w == 0)
    if width >= 4:
        return width * largest_divisor(n // width, 3 if lanes >= 16 else 2), width
    divisor = largest_divisor(n, 2 * lanes)
    return divisor, divisor


def matmul_row_tiles(m: int, lanes: int) -> tuple[int, int]:
    """(rows per tile, row tiles) of MatmulEpilogue over ``m`` static rows: tiles of the largest
    divisor up to ``matmul_tile_rows``, or of that many rows over zero-padded rows when those
    tiles average at least 1.5 real rows more (128 rows on AVX2: 22 tiles of 6, not 32 of 4;
    32 rows: 8 tiles of 4, not 6 of 6)."""
    most = matmul_tile_rows(lanes)
    divisor = largest_divisor(m, most)
    tiles = -(-m // most)
    if m > most and m / tiles >= divisor + 1.5:
        return most, tiles
    return divisor, m // divisor


def matmul_tasks(work: int, row_tiles: int, column_tiles: int, rows: int, lanes: int, cores: int) -> tuple[int, int, bool]:
    """(tasks, column tiles per task, whether the tasks run in parallel) of MatmulEpilogue:
    a tile of under half the register tile's rows takes as many column tiles as the free rows
    would have held (a divisor of the column tiles), leaving at least one task per core; a
    static matmul of at most MAX_SERIAL_STATIC_WORK multiply-adds runs on one core."""
    parallel = work > MAX_SERIAL_STATIC_WORK
    cores = cores if parallel else 1
    group = 1
    if rows * 2 <= matmul_tile_rows(lanes):
        group = next((g for g in range(matmul_tile_rows(lanes) // rows, 1, -1)
                      if column_tiles % g == 0 and column_tiles // g * row_tiles >= cores), 1)
    return row_tiles * column_tiles // group, group, parallel


def largest_divisor(extent: int, limit: int) -> int:
    """The largest tile of at most ``limit`` that divides ``extent`` (no remainder loop)."""
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def whole_vectors(width: int, lanes: int, max_vectors: int) -> int | None:
    """The widest run of whole vectors (at most ``max_vectors``) that divides ``width``, the
    tile the rules take for a row; None when not even one vector divides it."""
    return next((v * lanes for v in range(max_vectors, 0, -1) if width % (v * lanes) == 0), None)


def column_tile(width: int, lanes: int, max_vectors: int) -> int:
    """The columns of a direct conv's tile: whole vectors dividing the row; when none does and
    the row is longer than a vector, the run of whole vectors that computes the fewest columns
    with the last tile shifted back (ties to the wider); else a divisor of the row."""
    exact = whole_vectors(width, lanes, max_vectors)
    if exact:
        return exact
    if width <= lanes:
        return largest_divisor(width, lanes)
    tiles = [v * lanes for v in range(max_vectors, 0, -1) if v * lanes <= width]
    return min(tiles, key=lambda tile: -(-width // tile) * tile)


def pixel_tile(columns: int, widest: int = 8, narrowest_exact: int = 4) -> int:
    """The pixels of a blocked conv's tile (one vector each): the largest divisor of the row up
    to ``widest``; when none of at least ``narrowest_exact`` divides it, the tile of
    ``widest..narrowest_exact`` that computes the fewest pixels with the last one shifted back
    (ties to the wider)."""
    exact = largest_divisor(columns, widest)
    if exact >= narrowest_exact or columns < narrowest_exact:
        return exact
    return min(range(min(columns, widest), narrowest_exact - 1, -1), key=lambda tile: -(-columns // tile) * tile)


def root_loop_nests(func) -> int:
    """How many loop nests the function's root runs one after another: 1 when every block is
    computed in one nest (one task per row, or one task for a single row)."""
    body = func.body.block.body
    return len(body.seq) if isinstance(body, tvm.tirx.SeqStmt) else 1
