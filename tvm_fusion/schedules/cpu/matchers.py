"""The blocks of a matmul, of a direct conv and of a softmax as the rules that schedule them
read them, and what those rules choose alike: the matmul's register tile, the conv's tiles by
output width.

A helper module like ``helpers``: rules import from it, it defines no ScheduleRule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.sym import detect_linear_equation
from tvm.target import Target

from .helpers import (OneReduction, among, cpu_schedule, extent_of, inline_cheap_blocks, is_spatial, iter_kinds,
                      MIN_VECTOR_PIECE, largest_divisor, only_reduction, power_of_two_width, row_tile, same_extents)
from .symbolic_width import (is_static, overlapped_tile, schedule_by_width, schedule_static_width, static_except,
                             width_tiles)
from .target_info import vector_lanes, vector_registers

# -- Matmul ------------------------------------------------------------------------------------

# Rows of the register tile: 8 rows x 2 vectors of columns keeps 16 accumulators in
# AVX-512's 32 registers, with room for the B vectors and the broadcast A value.
MATMUL_TILE_ROWS = 8
MATMUL_K_UNROLL = 4
_TILE_VECTORS = 2


@dataclass
class MatmulAxes:
    """Positions of the matmul block's loops: batch loops, then i, j, k; with a weight in
    column panels (``passes/pack_matmul_weights.py``), j is the panel and ``n_inner`` the
    column within it (batch, i, panel, column, k)."""

    num_batch: int
    m: int
    n: int
    k: int
    n_inner: int | None = None


def match_matmul(block: s_tir.SBlock) -> MatmulAxes | None:
    """Axes of `C[b.., i, j] = C[b.., i, j] + A[.., i, k] * B[.., k, j]`, or None."""
    iter_vars = [iv.var for iv in block.iter_vars]
    kinds = [iv.iter_type for iv in block.iter_vars]
    if len(iter_vars) < 3 or kinds[-1] != tirx.IterVar.CommReduce:
        return None
    if any(kind != tirx.IterVar.DataPar for kind in kinds[:-1]):
        return None
    operands = _product_operands(block.body)
    if operands is None:
        return None
    store, lhs, rhs = operands
    *batch, i, j, k = iter_vars
    if _indices_are(store.indices, [*batch, i, j]) and _reads_as(lhs, batch, i, k) and _reads_as(rhs, batch, k, j):
        return MatmulAxes(num_batch=len(batch), m=len(batch), n=len(batch) + 1, k=len(batch) + 2)
    if len(iter_vars) < 4:
        return None
    *batch, i, panel, column, k = iter_vars
    if (_indices_are(store.indices, [*batch, i, panel, column]) and _reads_as(lhs, batch, i, k)
            and _indices_are(rhs.indices, [panel, k, column])):
        return MatmulAxes(num_batch=len(batch), m=len(batch), n=len(batch) + 1, k=len(batch) + 3,
                          n_inner=len(batch) + 2)
    return None


def rows_from_batch(block: s_tir.SBlock, axes: MatmulAxes) -> MatmulAxes:
    """``axes`` with a batch axis as the rows when the matmul has one row per batch item and a
    weight shared by the batch: an LSTM's outputs [steps, 1, K] times a classifier's [K, N] are
    ``steps`` rows of one GEMM (the weight read once per row tile), not ``steps`` matrix-vector
    products that each read the whole weight. The unit row axis then counts as a batch axis."""
    rows = block.iter_vars[axes.m].dom.extent
    if not (is_static(rows) and int(rows) == 1) or axes.num_batch == 0:
        return axes
    _, lhs, rhs = _product_operands(block.body)
    weight_vars = _vars_in(rhs.indices)
    lhs_batch = list(lhs.indices[:-2])
    for axis in reversed(range(axes.num_batch)):
        var = block.iter_vars[axis].var
        extent = block.iter_vars[axis].dom.extent
        if any(v.same_as(var) for v in weight_vars) or not any(index.same_as(var) for index in lhs_batch):
            continue  # the weight differs per item, or the item does not pick lhs rows
        if not is_static(extent) or int(extent) > 1:
            return dataclasses.replace(axes, m=axis)
    return axes


def batch_axes(axes: MatmulAxes) -> list[int]:
    """The positions of the batch axes: those before the columns, except the rows."""
    return [axis for axis in range(axes.num_batch + 1) if axis != axes.m]


def _vars_in(exprs) -> list:
    found = []
    for expr in exprs:
        tvm_ffi.structural_walk(expr, (tirx.Var, found.append))
    return found


def _product_operands(store) -> tuple | None:
    """(store, A load, B load) of ``C[..] = C[..] + A[..] * B[..]``, or None."""
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, product = store.value.a, store.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer)):
        return None
    if not isinstance(product, tirx.Mul):
        return None
    lhs, rhs = _strip_cast(product.a), _strip_cast(product.b)
    if not (isinstance(lhs, TensorLoad) and isinstance(rhs, TensorLoad)):
        return None
    return store, lhs, rhs


def _written_params(func: tirx.PrimFunc) -> list:
    written = []

    def visit(block):
        for region in block.writes:
            if any(region.source.same_as(p) for p in func.params) and not any(region.source.same_as(w) for w in written):
                written.append(region.source)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return written


# Columns below which a weight whose width the panel does not divide stays unpacked: the
# zero-padded last panel then costs at most 1/8 more multiply-adds.
_MIN_PADDED_PANELS = 8


def matmul_kernel(func: tirx.PrimFunc, target: Target) -> tuple[OneReduction, MatmulAxes] | None:
    """The kernel MatmulEpilogue schedules: for a CPU target, one matmul (``match_matmul``) of
    static columns with only spatial blocks after it; its blocks and axes, else None. The blocks
    are read as legalized: normalizing would drop unit loops (M=1) and fuse batch loops."""
    sch = cpu_schedule(func, target)
    kernel = None if sch is None else only_reduction(sch)
    if kernel is not None and kernel.prologue:
        kernel = _without_side_inputs(kernel)
    if kernel is None or kernel.prologue:
        return None  # a prologue or a second reduction
    axes = match_matmul(kernel.stmt)
    if axes is None or not is_static(kernel.stmt.iter_vars[axes.n].dom.extent):
        return None  # symbolic columns: a predicated vector loop would run scalar
    return kernel, axes


def _without_side_inputs(kernel: OneReduction) -> OneReduction | None:
    """The kernel with the blocks before its matmul that only the epilogue reads (an LSTM
    step's slice of the input projection, added to ``h · R``) inlined into their readers; None
    when one of them feeds the matmul (a real prologue) or cannot be inlined."""
    sch = kernel.sch
    operands = [region.source for region in kernel.stmt.reads]
    # All checked before any is inlined: inlining a Winograd conv's input transform, only to
    # find the next block feeds the product, took 0.75 s a kernel (nudenet's pipeline 9 s).
    if any(among(region.source, operands) for block in kernel.prologue for region in sch.get(block).writes):
        return None
    for block in kernel.prologue:
        try:
            sch.compute_inline(block)
        except s_tir.ScheduleError:
            return None
    return only_reduction(sch)


def packable_weight(func: tirx.PrimFunc, target: Target) -> tuple[int, int] | None:
    """(the parameter position of B, the panel width) when ``func`` is a kernel MatmulEpilogue
    schedules (``matmul_kernel``) whose B is a 2-D float32 parameter [K, N] of static size
    that column panels fit (``passes/pack_matmul_weights.py``); None otherwise."""
    found = matmul_kernel(func, target)
    if found is None or found[1].n_inner is not None:
        return None
    block, axes = found[0].stmt, found[1]
    _, _, rhs = _product_operands(block.body)
    if len(rhs.indices) != 2 or rhs.source.dtype != "float32":
        return None
    extents = [block.iter_vars[axis].dom.extent for axis in (axes.n, axes.k)]
    if not is_static(extents[1]):
        return None
    columns, depth = (int(e) for e in extents)
    panel = _TILE_VECTORS * vector_lanes(target, "float32")
    if columns <= panel or depth < 2:
        return None  # one panel is the matrix itself (and a unit panel or K axis would be folded away)
    if columns % panel and columns < _MIN_PADDED_PANELS * panel:
        return None
    if len(_written_params(func)) != 1:
        return None  # several outputs (training dropout's values and mask): MatmulMultiOutput's
    for index, param in enumerate(func.params):
        if param.same_as(rhs.source):
            return index, panel
    return None  # B is computed inside the kernel


def matmul_tile_rows(target: Target) -> int:
    """Rows per register tile (of two vectors): 8 with 32 vector registers; 6 with 16 (AVX2),
    where 8 x 2 accumulators plus the B vectors and A broadcast spill."""
    return MATMUL_TILE_ROWS if vector_registers(target) >= 32 else (16 - 4) // _TILE_VECTORS


def matmul_tile_columns(extent: int, lanes: int, target: Target) -> int:
    """Columns per tile: whole vectors when they divide the extent; else narrower power-of-two
    vectors, as many per row as the register file holds (120 columns on 16 lanes: 3 x 8); else
    the largest divisor."""
    for vectors in (_TILE_VECTORS, 1):
        if extent % (vectors * lanes) == 0:
            return vectors * lanes
    width = power_of_two_width(extent, lanes)
    if width >= MIN_VECTOR_PIECE:
        return width * largest_divisor(extent // width, _narrow_vectors_per_row(target))
    return largest_divisor(extent, _TILE_VECTORS * lanes)


def _narrow_vectors_per_row(target: Target) -> int:
    """Narrow vectors per tile row: the rows' accumulators, one B vector each and A's broadcast
    fill the register file (AVX-512: 8 rows x 3 + 3 + 1 = 28 of 32; AVX2: 6 x 2 + 2 + 1)."""
    rows = matmul_tile_rows(target)
    return max(1, (vector_registers(target) - 1) // (rows + 1))


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


# -- Direct conv -------------------------------------------------------------------------------


@dataclass
class ConvBlocks:
    """The blocks of a legalized conv kernel, in order: prologue pad, the conv, its epilogue."""

    pad: list
    conv: object
    epilogue: list
    depthwise: bool
    column_stride: int  # input elements between adjacent outputs along the tiled axis
    # One output column and static, unit-stride rows (a 1-D conv exported as an Nx1 Conv2d):
    # rows are then contiguous in memory like columns, and the rules tile them instead.
    tiles_rows: bool = False

    def tiled_loops(self, loops: list) -> list:
        """``loops`` (n, f, y, x, rc, ry, rx) with y and x swapped when the tiles run along the
        rows, so that a rule reads ``n, f, rows, columns, ...`` either way."""
        n, f, y, x, *reduction = loops
        return [n, f, x, y, *reduction] if self.tiles_rows else loops


def match_conv(sch: s_tir.Schedule) -> ConvBlocks | None:
    """Blocks of ``[pad] -> conv2d_nchw (SSSSRRR) -> elementwise..``, or None.

    Cheap spatial prologue blocks (an SE scale) are inlined into the pad/conv first. Output
    rows and columns may be symbolic; batch, channels and the kernel window must be static.
    """
    inline_cheap_blocks(sch)
    kernel = only_reduction(sch)
    if kernel is None:
        return None
    stmt = kernel.stmt
    if iter_kinds(stmt) != "SSSSRRR" or not static_except(stmt, (2, 3)):
        return None
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    if not isinstance(store.value.b, tirx.Mul):
        return None
    n, f, y, x, rc, ry, rx = (iv.var for iv in stmt.iter_vars)
    if not all(a.same_as(b) for a, b in zip(store.indices, (n, f, y, x))):
        return None
    product = store.value.b
    weight_is_b = _loads_at(product.b, (f, rc, ry, rx))
    if not (weight_is_b or _loads_at(product.a, (f, rc, ry, rx))):
        return None
    # The data side may carry an inlined prologue (an SE scale): the feature map is its
    # largest 4-D input.
    data_side = product.a if weight_is_b else product.b
    maps = [ld for ld in _loads(data_side) if len(ld.indices) == 4 and is_static(ld.source.shape[1])]
    if not maps:
        return None
    feature_map = max(maps, key=lambda load: _size(load.source))
    channels_in = int(feature_map.source.shape[1])
    stride, _ = detect_linear_equation(feature_map.indices[3], [x]) or (1, None)
    row_stride, _ = detect_linear_equation(feature_map.indices[2], [y]) or (0, None)
    channels_out = int(stmt.iter_vars[1].dom.extent)
    depthwise = int(stmt.iter_vars[4].dom.extent) == 1 and channels_in == channels_out > 1
    height, width = (iv.dom.extent for iv in stmt.iter_vars[2:4])
    tiles_rows = (is_static(width) and int(width) == 1 and is_static(height) and int(height) > 1
                  and int(row_stride) == 1)
    return ConvBlocks(kernel.prologue, kernel.block, kernel.epilogue, depthwise,
                      1 if tiles_rows else int(stride), tiles_rows)


def conv_kernel(func, target: Target, depthwise: bool) -> tuple[s_tir.Schedule, ConvBlocks, int] | None:
    """For a CPU PrimFunc that is a conv (``match_conv``), depthwise or not as asked: a schedule
    of it, its blocks and the vector lanes of its dtype; None otherwise."""
    sch = cpu_schedule(func, target)
    blocks = None if sch is None else match_conv(sch)
    if blocks is None or blocks.depthwise != depthwise:
        return None
    return sch, blocks, vector_lanes(target, sch.get(blocks.conv).writes[0].source.dtype)


def schedule_conv_tiles(func: tirx.PrimFunc, sch: s_tir.Schedule, blocks: ConvBlocks, lanes: int,
                        max_vectors: int, schedule: Callable) -> s_tir.Schedule | None:
    """The conv scheduled by ``schedule(sch, blocks, ow_tile)``, which tiles the output columns
    and returns the column-tile loop: at a static width once, ``row_tile`` columns a tile, or
    whole vectors with the last tile shifted back when no whole vector divides the row (13,
    26, 52 columns); at a symbolic width once per tile width on copies of ``func``
    (``symbolic_width.py``)."""
    width = sch.get(blocks.tiled_loops(sch.get_loops(blocks.conv))[3]).extent
    if is_static(width):
        width = int(width)
        tile = row_tile(width, lanes, max_vectors)
        if tile % lanes and width > lanes:
            tile = overlapped_tile(width, [vectors * lanes for vectors in range(max_vectors, 0, -1)])
        return schedule_static_width(sch, width, tile, lambda copy, tile: schedule(copy, blocks, tile))
    return schedule_by_width(func, width, width_tiles(max_vectors * lanes, lanes),
                             lambda copy, tile: schedule(copy, match_conv(copy), tile))


def splits_column_phases(sch: s_tir.Schedule, blocks: ConvBlocks) -> bool:
    """True for a stride-2 conv over a padded map of static width: ``split_column_phases``
    applies."""
    return (blocks.column_stride == 2 and bool(blocks.pad) and not blocks.tiles_rows
            and is_static(sch.get(blocks.pad[-1]).writes[0].source.shape[-1]))


def split_column_phases(sch: s_tir.Schedule, blocks: ConvBlocks) -> None:
    """For a stride-2 conv over a padded map (``splits_column_phases``): store the padded map
    as each row's even columns, then its odd ones, so that every window tap reads one
    contiguous vector instead of gathering every other column."""
    if splits_column_phases(sch, blocks):
        sch.transform_layout(blocks.pad[-1], ("write", 0),
                             lambda *index: (*index[:-1], index[-1] % 2, index[-1] // 2), pad_value=0.0)


def _loads_at(expr, variables) -> bool:
    return isinstance(expr, TensorLoad) and _indices_are(expr.indices, variables)


def _loads(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, (TensorLoad, found.append))
    return found


def _size(buffer) -> int:
    """Elements of ``buffer``, a symbolic dim counting as larger than any static one (the
    feature map of a model compiled for a range of sizes, next to a static gate)."""
    size = 1
    for dim in buffer.shape:
        size *= int(dim) if is_static(dim) else 1 << 40
    return size


# -- Softmax -----------------------------------------------------------------------------------


def is_softmax(sch: s_tir.Schedule) -> bool:
    """Exactly two reductions, a max then a sum, over the same domain, each reducing its last
    iteration axis (which axis of the input that reads is up to the rule: ``Softmax`` takes
    the innermost, ``SoftmaxOverOuterAxis`` the others)."""
    stmts = [sch.get(block) for block in sch.get_child_blocks(get_root_block(sch))]
    reductions = [stmt for stmt in stmts if not is_spatial(stmt)]
    if len(reductions) != 2:
        return False
    combiners = [type(getattr(stmt.body, "value", None)) for stmt in reductions]
    if combiners != [tirx.Max, tirx.Add]:
        return False
    domains = []
    for stmt in reductions:
        kinds = [iv.iter_type for iv in stmt.iter_vars]
        if kinds[-1] != tirx.IterVar.CommReduce or tirx.IterVar.CommReduce in kinds[:-1]:
            return False
        domains.append([extent_of(iv.dom.extent) for iv in stmt.iter_vars])
    return same_extents(*domains)
