"""Register-tiled CPU matmul with its injective epilogue computed inside each output tile."""

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import static_product
from ...kernels.matmul import MatmulAxes, batch_axes, matmul_kernel, rows_from_batch
from ...targets.target_info import num_cores, vector_lanes
from .helpers import compute_epilogue_at, extent, largest_divisor, tile_factor, vectorize_in_registers, vectorized_init
from .matchers import MATMUL_K_UNROLL, matmul_tile_columns, matmul_tile_rows
from .panel_prefetch import prefetch_next_panel
from .small_extent import MAX_SERIAL_STATIC_WORK, MIN_PARALLEL_ELEMENTS, MIN_PARALLEL_TILE_WORK, serial_when_small


class MatmulEpilogue(ScheduleRule):
    """C[b.., i, j] += A[b.., i, k] * B[(b..), k, j], then injective blocks, fused per tile.

    The accumulator tile lives in registers; bias, activations and residual adds are computed
    from it before the tile is stored, so the matmul result never goes through memory.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = matmul_kernel(func, target)
        if found is None:
            return None
        kernel, axes = found
        sch, matmul = kernel.sch, kernel.block
        axes = rows_from_batch(sch.get(matmul), axes)
        dtype = sch.get(matmul).writes[0].source.dtype
        sch = _schedule(sch, matmul, kernel.epilogue, axes, vector_lanes(target, dtype), target)
        return serial_when_small(sch, MIN_PARALLEL_TILE_WORK)  # a few symbolic rows: one core


def _schedule(sch, matmul, epilogue, axes: MatmulAxes, lanes: int, target: Target) -> s_tir.Schedule:
    max_rows = matmul_tile_rows(target)
    rows_extent = sch.get(matmul).iter_vars[axes.m].dom.extent
    padded_lhs = None
    if not isinstance(rows_extent, tirx.IntImm) or pads_rows(int(rows_extent), max_rows):
        padded_lhs, unpad = _pad_rows(sch, matmul, axes, max_rows)
        epilogue = [unpad, *epilogue]
    loops = sch.get_loops(matmul)
    batch = [loops[axis] for axis in batch_axes(axes)]
    m_loop, k_loop = loops[axes.m], loops[axes.k]
    tile_rows = tile_factor(sch.get(m_loop).extent, max_rows)
    k_extent = extent(sch, k_loop)
    # A symbolic K is left unsplit: a predicated unrolled step would test every product.
    k_unroll = largest_divisor(k_extent, MATMUL_K_UNROLL) if isinstance(k_extent, int) else 1

    m_outer, m_inner = sch.split(m_loop, [None, tile_rows])
    if axes.n_inner is None:
        n_outer, n_inner = sch.split(loops[axes.n], [None, matmul_tile_columns(extent(sch, loops[axes.n]), lanes, target)])
    else:  # a weight in column panels: a tile is one panel
        n_outer, n_inner = loops[axes.n], loops[axes.n_inner]
    k_outer, k_inner = sch.split(k_loop, [None, k_unroll])
    row_tiles = extent(sch, m_outer)
    work = _static_work(sch, matmul)
    parallel = work is None or work > MAX_SERIAL_STATIC_WORK
    group = _column_group(sch, [*batch, n_outer, m_outer], tile_rows, max_rows, num_cores(target) if parallel else 1)
    inner_columns = [n_inner]
    if group > 1:
        n_outer, n_group = sch.split(n_outer, [None, group])
        inner_columns = [n_group, n_inner]
    # Column panels outermost: a K x tile_cols panel of B stays in cache while the
    # row tiles of A stream past it.
    sch.reorder(*batch, n_outer, m_outer, k_outer, k_inner, m_inner, *inner_columns)
    # Accumulate in a tile-sized buffer; the epilogue (or a plain store) reads it per tile.
    try:
        output = compute_epilogue_at(sch, matmul, epilogue, m_outer)
        after_tiles = False
    except (s_tir.ScheduleError, ValueError):  # TVM raises the region analysis' failure as a ValueError
        # An epilogue that reads the product across tiles (a power spectrum's column pairs
        # in packed panels) runs after them, in the same kernel, from the cached product.
        output, after_tiles = epilogue[-1], True
    tile = sch.fuse(*batch, n_outer, m_outer)
    if parallel:
        sch.parallel(tile)
    if group > 1:
        sch.unroll(inner_columns[0])
    if padded_lhs is not None:
        # A's rows are copied (zero-padded) once, before the tiles: copied per tile, every
        # column panel would copy them again (bert_tiny at sequence 100: 1.17x -> 0.9-1.0x the
        # static build). Serial: M x K copies are ~1 % of the M x K x N multiply-adds.
        _vectorize_tile_store(sch, padded_lhs)
    if k_unroll > 1:
        sch.unroll(k_inner)
    sch.unroll(m_inner)
    vectorize_in_registers(sch, n_inner, lanes)
    vectorized_init(sch, matmul, k_outer)
    if after_tiles:
        _schedule_whole_epilogue(sch, output, lanes)
    else:
        _vectorize_tile_store(sch, output, sch.get(n_inner).extent if group > 1 else None)
    if axes.n_inner is not None and group == 1:
        sch = prefetch_next_panel(sch, matmul, tile, k_outer, row_tiles)
    return sch


def _schedule_whole_epilogue(sch, output, lanes: int) -> None:
    """The epilogue's loops after the tiles: the outer ones fused, and parallel where there are
    enough elements (``MIN_PARALLEL_ELEMENTS``), the innermost in vectors."""
    *outer, innermost = sch.get_loops(output)
    elements = _static_work(sch, output)
    if outer and (elements is None or elements >= MIN_PARALLEL_ELEMENTS):
        sch.parallel(sch.fuse(*outer))
    length = extent(sch, innermost)
    if isinstance(length, int) and length > lanes:
        innermost = sch.split(innermost, [None, lanes])[1]
    if isinstance(length, int) and length > 1:
        sch.vectorize(innermost)


def _static_work(sch, block) -> int | None:
    """The block's iterations, when static: a matmul's multiply-adds, an epilogue's elements."""
    return static_product(var.dom.extent for var in sch.get(block).iter_vars)


def _column_group(sch, tile_loops, tile_rows: int, max_rows: int, cores: int) -> int:
    """Column tiles one task computes together where a tile has fewer rows than the register
    tile holds, so that it keeps as many accumulators: a one-row tile (a GEMV, a recurrent
    step) has two, and waits on each multiply-add's latency. Leaves ``cores`` tasks at least."""
    *batch, columns, rows = (extent(sch, loop) for loop in tile_loops)
    if tile_rows * 2 > max_rows or not isinstance(columns, int):
        return 1
    others = math.prod(e if isinstance(e, int) else cores for e in (*batch, rows))  # a symbolic one: enough
    for group in range(max_rows // tile_rows, 1, -1):
        if columns % group == 0 and columns // group * others >= cores:
            return group
    return 1


def pads_rows(rows: int, max_rows: int) -> bool:
    """Whether a static row count runs faster padded to tiles of ``max_rows`` than in tiles of
    its largest divisor up to ``max_rows``: when the padded tiles hold at least 1.5 rows more
    on average. 128 rows on AVX2 pad (22 tiles of 6, 5.8 real rows each, against 32 tiles of
    4; static builds at sequence 128, same-process A/B on Zen 3: bert_tiny 7.77 -> 7.21 ms,
    gpt2_tiny 7.14 -> 6.37 ms); 32 rows do not (6 tiles of 6 hold 5.3: ddddocr's 32 x 1024 x
    8210 classifier, kernel alone on Zen 1, 8.80 ms padded against 8.17 ms in tiles of 4)."""
    divisor = largest_divisor(rows, max_rows)
    return rows > max_rows and rows / -(-rows // max_rows) >= divisor + 1.5


def _pad_rows(sch, matmul, axes: MatmulAxes, rows: int):
    """Pad the row count up to whole register tiles (``pad_einsum``): the matmul then
    runs on full, unpredicated row tiles of a zero-padded copy of A's rows, and only the
    tile's store (the unpad and epilogue) tests which rows exist. Returns the padding block
    (A's rows, copied once) and the unpad block (padded accumulator -> matmul result).
    """
    factors = [1] * len(sch.get(matmul).iter_vars)
    factors[axes.m] = rows
    sch.pad_einsum(matmul, factors)
    (padded_lhs,) = sch.get_producers(matmul)
    (unpad,) = sch.get_consumers(matmul)
    return padded_lhs, unpad


def _vectorize_tile_store(sch, output, column_tile=None) -> None:
    """Vectorize the innermost loop of a copy: the tile's epilogue columns, A's padded rows; a
    task of several column tiles stores them one column tile a vector."""
    innermost = sch.get_loops(output)[-1]
    length = extent(sch, innermost)
    if column_tile is not None and length > int(column_tile):
        innermost = sch.split(innermost, [None, int(column_tile)])[1]
        length = int(column_tile)
    if isinstance(length, int) and length > 1:  # a symbolic K (the padded A copy) stays scalar
        sch.vectorize(innermost)
