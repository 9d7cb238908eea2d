"""How a legalized matmul kernel reads, as the CPU matmul rules and the weight packing both
read it: the axes of ``C[b.., i, j] += A[.., i, k] * B[.., k, j]`` (``match_matmul``), the kernels
MatmulEpilogue schedules (``matmul_kernel``) and, of those, the ones whose weight is a parameter
``PackMatmulWeights`` may store in column panels (``weight_parameter``).

Below ``passes/`` and ``schedules/`` (like ``blocks``): the pass packs only weights of kernels
the rule then schedules, in panels as wide as its register tile (``MATMUL_TILE_VECTORS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.target import Target

from .blocks import OneReduction, among, indices_are, is_cpu_kernel, is_static, only_reduction

# Columns of MatmulEpilogue's register tile, in vectors: the width of a packed weight's panels.
MATMUL_TILE_VECTORS = 2


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
    if indices_are(store.indices, [*batch, i, j]) and _reads_as(lhs, batch, i, k) and _reads_as(rhs, batch, k, j):
        return MatmulAxes(num_batch=len(batch), m=len(batch), n=len(batch) + 1, k=len(batch) + 2)
    if len(iter_vars) < 4:
        return None
    *batch, i, panel, column, k = iter_vars
    if (indices_are(store.indices, [*batch, i, panel, column]) and _reads_as(lhs, batch, i, k)
            and indices_are(rhs.indices, [panel, k, column])):
        return MatmulAxes(num_batch=len(batch), m=len(batch), n=len(batch) + 1, k=len(batch) + 3,
                          n_inner=len(batch) + 2)
    return None


def panel_weight(block: s_tir.SBlock):
    """B of a matmul block that reads its weight in column panels ([panels, K, columns]), else None."""
    axes = match_matmul(block)
    if axes is None or axes.n_inner is None:
        return None
    return _product_operands(block.body)[2].source


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


def matmul_kernel(func: tirx.PrimFunc, target: Target) -> tuple[OneReduction, MatmulAxes] | None:
    """The kernel MatmulEpilogue schedules: for a CPU target, one matmul (``match_matmul``) of
    static columns with only spatial blocks after it; its blocks and axes, else None. The blocks
    are read as legalized: normalizing would drop unit loops (M=1) and fuse batch loops."""
    kernel = only_reduction(s_tir.Schedule(func)) if is_cpu_kernel(func, target) else None
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


@dataclass
class WeightParameter:
    """B of a matmul kernel passed as a parameter: its position and its [K, N] extents."""

    param: int
    depth: int
    columns: int


def weight_parameter(func: tirx.PrimFunc, target: Target) -> WeightParameter | None:
    """B of ``func`` when ``func`` is a kernel MatmulEpilogue schedules (``matmul_kernel``), its
    weight not yet in panels, whose only output is the matmul's and whose B is a 2-D float32
    parameter [K, N] of static size: the weights ``passes/pack_matmul_weights.py`` may store in
    column panels. None otherwise."""
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
    if len(_written_params(func)) != 1:
        return None  # several outputs (training dropout's values and mask): MatmulMultiOutput's
    columns, depth = (int(e) for e in extents)
    for index, param in enumerate(func.params):
        if param.same_as(rhs.source):
            return WeightParameter(index, depth, columns)
    return None  # B is computed inside the kernel


def _strip_cast(expr: tirx.Expr) -> tirx.Expr:
    return expr.value if isinstance(expr, tirx.Cast) else expr


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
