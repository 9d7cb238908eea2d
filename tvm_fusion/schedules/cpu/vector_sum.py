"""Sum a block's innermost reduction into one vector of partial sums, then reduce the vector:
a whole reduction at the root (``vectorize_reduction``), or a kernel's row reductions under its
row loop (``schedule_rows``: norms, reductions over trailing axes)."""

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block

from ...kernels.blocks import is_spatial
from .helpers import extent, iter_kinds, parallel_rows, vectorize_innermost, vectorized_init

# The output blocks of TOPI's layer_norm and rms_norm, as LegalizeOps names them: the kernels
# whose row sums ``schedule_rows`` splits into lanes.
NORM_BLOCKS = ("T_layer_norm", "T_rms_norm")


def vectorize_reduction(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """Rewrite ``out[s] += f(s, r)`` (reduction loops innermost) as ``lanes`` running partial
    sums updated by one vector add/FMA per step, and a final horizontal sum.

    A scalar reduction loop is one long dependency chain of adds; split across vector lanes it
    runs ``lanes`` chains at once from contiguous loads. Returns False (block untouched) when
    the reduction is too short or not a multiple of ``lanes``.
    """
    if len(sch.get_loops(block)) <= iter_kinds(sch.get(block)).count("R"):
        return False  # no loop outside the reduction
    partial = _lane_partial_sums(sch, block, lanes)
    if partial is None:
        return False
    *_, partial_outer, partial_lane = sch.get_loops(partial)
    sch.vectorize(partial_lane)
    vectorized_init(sch, partial, partial_outer)
    return True


def schedule_rows(sch: s_tir.Schedule, blocks: list, row_axes: int, lanes: int) -> s_tir.Schedule:
    """One row per parallel task, every block computed under it (the row's intermediates stay in
    cache): element-wise blocks on vectors, each reduction over the row as ``lanes`` partial
    sums updated by one vector op per step (a scalar sum is one chain of dependent adds, a
    quarter of the memory's pace on a LayerNorm), then their horizontal sum. Where the first
    block is an output (a skip norm's sum), its row loop leads and the rest follows it."""
    # rfactor needs each reduction still at the root: split the sums into lanes first.
    order, partials = [], []
    for block in blocks:
        partial = None if is_spatial(sch.get(block)) else _lane_partial_sums(sch, block, lanes)
        if partial is not None:
            order.append(partial)
            partials.append(partial)
        order.append(block)
    outputs = [sch.get(b) for b in sch.get_output_blocks(get_root_block(sch))]
    if any(sch.get(order[0]).same_as(o) for o in outputs):
        row = sch.fuse(*sch.get_loops(order[0])[:row_axes])
        for block in order[1:]:
            sch.reverse_compute_at(block, row, preserve_unit_loops=True)
    else:
        row = sch.fuse(*sch.get_loops(order[-1])[:row_axes])
        for block in reversed(order[:-1]):
            sch.compute_at(block, row, preserve_unit_loops=True)
    parallel_rows(sch, row)
    for block in order:
        stmt = sch.get(block)
        if is_spatial(stmt):
            vectorize_innermost(sch, block, row, lanes)
        elif any(stmt.same_as(sch.get(p)) for p in partials):
            _vectorize_lanes(sch, block, row_axes)
    return sch


def _lane_partial_sums(sch: s_tir.Schedule, block, lanes: int):
    """Split a row reduction (its reduction axes innermost, fused into one: an instance norm's
    H x W) into ``lanes`` interleaved partial sums (rfactor); None where its static length is
    not a multiple of ``lanes`` over one vector."""
    stmt = sch.get(block)
    reductions = sum(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars)
    if reductions == 0 or not iter_kinds(stmt).endswith("R" * reductions):
        return None
    loops = sch.get_loops(block)[-reductions:]
    extents = [extent(sch, loop) for loop in loops]
    if not all(isinstance(e, int) for e in extents) or math.prod(extents) <= lanes or math.prod(extents) % lanes:
        return None
    fused = sch.fuse(*loops) if reductions > 1 else loops[0]
    _, lane = sch.split(fused, [None, lanes])
    return sch.rfactor(lane, factor_axis=len(stmt.iter_vars) - reductions)


def _vectorize_lanes(sch: s_tir.Schedule, partial, row_axes: int) -> None:
    """Lane loop innermost, under the reduction loop, as one vector; the init likewise.

    Under the row loop, the partial-sum block's loops follow its iter vars: lane, the
    (unit) row axes, then the reduction.
    """
    loops = sch.get_loops(partial)
    lane, reduction = loops[-(row_axes + 2)], loops[-1]
    sch.reorder(reduction, lane)
    sch.vectorize(lane)  # before decompose_reduction: the update alone is no reduction block
    vectorized_init(sch, partial, reduction)
