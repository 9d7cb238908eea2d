"""Register-tiled CPU matmul with its injective epilogue computed inside each output tile."""

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .inline import only_reduction
from .small_extent import MIN_PARALLEL_TILE_WORK, serial_when_small
from .target_info import vector_lanes

# Rows of the register tile: 8 rows x 2 vectors of columns keeps 16 accumulators in
# AVX-512's 32 registers, with room for the B vectors and the broadcast A value.
_MAX_TILE_ROWS = 8
_TILE_VECTORS = 2
_K_UNROLL = 4


@dataclass
class _MatmulAxes:
    """Positions of the matmul block's loops: batch loops, then i, j, k."""

    num_batch: int
    m: int
    n: int
    k: int


class MatmulEpilogue(ScheduleRule):
    """C[b.., i, j] += A[b.., i, k] * B[(b..), k, j], then injective blocks, fused per tile.

    The accumulator tile lives in registers; bias, activations and residual adds are computed
    from it before the tile is stored, so the matmul result never goes through memory.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        # Read the blocks as legalized: normalizing would drop unit loops (M=1) and fuse batch loops.
        found = only_reduction(sch)
        if found is None or found[1] != 0:
            return None  # a prologue or a second reduction: not this rule's shape
        blocks = found[0]
        matmul = blocks[0]
        axes = _match_matmul(sch.get(matmul))
        if axes is None:
            return None
        if not isinstance(sch.get(matmul).iter_vars[axes.n].dom.extent, tirx.IntImm):
            return None  # symbolic columns: a predicated vector loop would run scalar
        epilogue = list(blocks[1:])
        dtype = sch.get(matmul).writes[0].source.dtype
        sch = _schedule(sch, matmul, epilogue, axes, vector_lanes(target, dtype))
        return serial_when_small(sch, MIN_PARALLEL_TILE_WORK)  # a few symbolic rows: one core


def _match_matmul(block: s_tir.SBlock) -> _MatmulAxes | None:
    """Axes of `C[b.., i, j] = C[b.., i, j] + A[.., i, k] * B[.., k, j]`, or None."""
    iter_vars = [iv.var for iv in block.iter_vars]
    kinds = [iv.iter_type for iv in block.iter_vars]
    if len(iter_vars) < 3 or kinds[-1] != tirx.IterVar.CommReduce:
        return None
    if any(kind != tirx.IterVar.DataPar for kind in kinds[:-1]):
        return None
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    *batch, i, j, k = iter_vars
    if not _indices_are(store.indices, [*batch, i, j]):
        return None
    acc, product = store.value.a, store.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer)):
        return None
    if not isinstance(product, tirx.Mul):
        return None
    lhs, rhs = _strip_cast(product.a), _strip_cast(product.b)
    if not (isinstance(lhs, TensorLoad) and isinstance(rhs, TensorLoad)):
        return None
    if not (_reads_as(lhs, batch, i, k) and _reads_as(rhs, batch, k, j)):
        return None
    return _MatmulAxes(num_batch=len(batch), m=len(batch), n=len(batch) + 1, k=len(batch) + 2)



def _strip_cast(expr: tirx.Expr) -> tirx.Expr:
    return expr.value if isinstance(expr, tirx.Cast) else expr


def _indices_are(indices, variables) -> bool:
    return len(indices) == len(variables) and all(
        index.same_as(var) for index, var in zip(indices, variables)
    )


def _reads_as(load: TensorLoad, batch, row, col) -> bool:
    """True if `load` reads [batch.., row, col], its batch dims indexed or broadcast (constant)."""
    if len(load.indices) < 2:  # a vector operand (ONNX MatMul with a 1-D side): not a GEMM
        return False
    *load_batch, load_row, load_col = load.indices
    if not (load_row.same_as(row) and load_col.same_as(col)):
        return False
    if len(load_batch) > len(batch):
        return False
    aligned = batch[len(batch) - len(load_batch):]
    return all(
        index.same_as(var) or isinstance(index, tirx.IntImm)
        for index, var in zip(load_batch, aligned)
    )


def _largest_divisor(extent: int, limit: int) -> int:
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def _tile(extent, limit: int) -> int:
    """A static extent's largest divisor up to ``limit`` (no remainder); ``limit`` itself for a
    symbolic extent, whose last tile is then predicated."""
    return _largest_divisor(int(extent), limit) if isinstance(extent, tirx.IntImm) else limit


def _tile_columns(extent: int, lanes: int) -> int:
    """Columns per tile: whole vectors when they divide the extent, else the largest divisor."""
    for vectors in (_TILE_VECTORS, 1):
        if extent % (vectors * lanes) == 0:
            return vectors * lanes
    return _largest_divisor(extent, _TILE_VECTORS * lanes)


def _extent(sch: s_tir.Schedule, loop):
    """The loop's extent: an int when static, else the symbolic expression."""
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else extent


def _schedule(sch, matmul, epilogue, axes: _MatmulAxes, lanes: int) -> s_tir.Schedule:
    rows_extent = sch.get(matmul).iter_vars[axes.m].dom.extent
    padded_lhs = None
    if not isinstance(rows_extent, tirx.IntImm):
        padded_lhs, unpad = _pad_rows(sch, matmul, axes)
        epilogue = [unpad, *epilogue]
    loops = sch.get_loops(matmul)
    batch = loops[: axes.num_batch]
    m_loop, n_loop, k_loop = loops[axes.m], loops[axes.n], loops[axes.k]
    tile_rows = _tile(sch.get(m_loop).extent, _MAX_TILE_ROWS)
    tile_cols = _tile_columns(_extent(sch, n_loop), lanes)
    k_extent = _extent(sch, k_loop)
    # A symbolic K is left unsplit: a predicated unrolled step would test every product.
    k_unroll = _largest_divisor(k_extent, _K_UNROLL) if isinstance(k_extent, int) else 1

    m_outer, m_inner = sch.split(m_loop, [None, tile_rows])
    n_outer, n_inner = sch.split(n_loop, [None, tile_cols])
    k_outer, k_inner = sch.split(k_loop, [None, k_unroll])
    # Column panels outermost: a K x tile_cols panel of B stays in cache while the
    # row tiles of A stream past it.
    sch.reorder(*batch, n_outer, m_outer, k_outer, k_inner, m_inner, n_inner)

    # Accumulate in a tile-sized buffer; the epilogue (or a plain store) reads it per tile.
    writeback = sch.cache_write(matmul, 0, "local")
    chain = [writeback, *epilogue]
    for block in chain[:-1]:
        sch.compute_inline(block)
    output = chain[-1]
    sch.reverse_compute_at(output, m_outer, preserve_unit_loops=True)
    if padded_lhs is not None:
        sch.compute_at(padded_lhs, m_outer, preserve_unit_loops=True)
        _vectorize_tile_store(sch, padded_lhs, lanes)

    tile = sch.fuse(*batch, n_outer, m_outer)
    sch.parallel(tile)
    if k_unroll > 1:
        sch.unroll(k_inner)
    sch.unroll(m_inner)
    sch.vectorize(n_inner)
    init = sch.decompose_reduction(matmul, k_outer)
    sch.vectorize(sch.get_loops(init)[-1])
    _vectorize_tile_store(sch, output, lanes)
    return sch


def _pad_rows(sch, matmul, axes: _MatmulAxes):
    """Pad a symbolic row count up to whole register tiles (``pad_einsum``): the matmul then
    runs on full, unpredicated 8-row tiles of a zero-padded copy of A's rows, and only the
    tile's store (the unpad and epilogue) tests which rows exist. Returns the padding block
    (A's rows, copied per tile) and the unpad block (padded accumulator -> matmul result).
    """
    factors = [1] * (axes.num_batch + 3)
    factors[axes.m] = _MAX_TILE_ROWS
    sch.pad_einsum(matmul, factors)
    (padded_lhs,) = sch.get_producers(matmul)
    (unpad,) = sch.get_consumers(matmul)
    sch.set_scope(padded_lhs, 0, "local")  # a private tile per task once computed at the tile
    return padded_lhs, unpad


def _vectorize_tile_store(sch, output, lanes: int) -> None:
    """Vectorize the innermost loop of a per-tile copy: the epilogue's columns, A's padded row."""
    innermost = sch.get_loops(output)[-1]
    extent = _extent(sch, innermost)
    if isinstance(extent, int) and extent > 1:  # a symbolic K (the padded A copy) stays scalar
        sch.vectorize(innermost)
