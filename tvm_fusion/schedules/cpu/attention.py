"""Fused attention on CPU: one block of query rows at a time, its scores in a cache-resident tile.

The function FuseTIR makes of an ``attention`` composite computes, over full [.., Sq, Skv]
buffers: scores = Q·Kᵀ, logits = scale/mask(scores), max, exp, sum, probs = exp/sum,
context = probs·V, then the head merge. This rule computes all of it under one parallel loop
over (batch, head, block of R query rows), so every seq x seq intermediate shrinks to an
R x Skv tile that stays in L1/L2; Q, K and V are read straight from the projections (the head
split transposes are inlined) and the head merge writes the output in place.

The tiles are stored key-major ([Skv, R]), so that every step runs on vectors of R query rows:
the Q·Kᵀ micro-kernel broadcasts K[j, d] against a vector of Qᵀ[d, rows], and the softmax max
and sum become element-wise vector max/add over the key axis, with no horizontal reductions.
The math is the legalized softmax's own (max-subtracted exp), only reordered by loop
transformations, so masked (-inf or dtype-min) and fully-masked rows behave exactly as unfused.
A two-pass row tile is used instead of FlashAttention's online softmax: a schedule cannot change
the arithmetic, and for key lengths up to a few thousand the row tile fits in L2 anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .inline import has_static_extents, is_spatial
from .matmul_epilogue import _largest_divisor, _match_matmul
from .target_info import vector_lanes

# Bytes of row tiles (scores, logits, exp, probs) one task may keep: half of a 1 MiB L2.
_TILE_BUDGET_BYTES = 512 * 1024
_TILE_KEYS = 8        # keys per register tile of the Q·Kᵀ micro-kernel (x 2 vectors of rows)
_TILE_ROWS = 8        # rows per register tile of the probs·V micro-kernel


@dataclass
class _Parts:
    """The blocks of a fused attention function, in dataflow order."""

    q_tile: object | None  # producer of the scores' Q operand (a head-split transpose), if any
    scores: object
    logits: object | None  # what the softmax max reads, when it is not the raw scores
    row_max: object
    exp: object
    row_sum: object
    probs: object
    context: object
    merge: list            # head-merge blocks after the context (empty: context is the output)
    others: list           # every other spatial block (head split reshapes, scale, mask...)


class Attention(ScheduleRule):
    """Q·Kᵀ -> element-wise -> row max -> exp -> row sum -> probs -> probs·V [-> head merge]."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        parts = _find_parts(sch)
        if parts is None:
            return None
        dtype = sch.get(parts.context).writes[0].source.dtype
        try:
            _schedule(sch, parts, vector_lanes(target, str(dtype)))
        except s_tir.ScheduleError:
            return None  # a variant the structural checks did not anticipate: leave it to other rules
        return sch


def _find_parts(sch: s_tir.Schedule) -> _Parts | None:
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    stmts = [sch.get(block) for block in blocks]
    reductions = [i for i, stmt in enumerate(stmts) if not is_spatial(stmt)]
    if len(reductions) != 4:
        return None
    i_scores, i_max, i_sum, i_context = reductions
    scores, context = stmts[i_scores], stmts[i_context]
    if _match_matmul(scores) is None or _match_matmul(context) is None:
        return None
    if not has_static_extents(scores, context):
        return None
    row_axes = len(scores.iter_vars) - 2  # batch.., query row
    if not (_is_row_reduction(stmts[i_max], tirx.Max, row_axes)
            and _is_row_reduction(stmts[i_sum], tirx.Add, row_axes)):
        return None

    writers = {stmt.writes[0].source: i for i, stmt in enumerate(stmts)}
    q_buffer, _ = _matmul_operands(scores)
    probs_buffer, _ = _matmul_operands(context)
    i_logits = writers.get(_reduced_buffer(stmts[i_max]))
    i_exp = writers.get(_reduced_buffer(stmts[i_sum]))
    i_probs = writers.get(probs_buffer)
    i_q = writers.get(q_buffer)
    if i_logits is None or i_exp is None or i_probs is None:
        return None
    if not (i_scores <= i_logits < i_max < i_exp < i_sum < i_probs < i_context):
        return None
    kept = {i_scores, i_logits, i_max, i_exp, i_sum, i_probs, i_context, i_q}
    return _Parts(
        q_tile=blocks[i_q] if i_q is not None else None,
        scores=blocks[i_scores],
        logits=blocks[i_logits] if i_logits != i_scores else None,
        row_max=blocks[i_max], exp=blocks[i_exp], row_sum=blocks[i_sum],
        probs=blocks[i_probs], context=blocks[i_context],
        merge=blocks[i_context + 1:],
        others=[b for i, b in enumerate(blocks[:i_context]) if i not in kept],
    )


def _is_row_reduction(stmt, combiner, row_axes: int) -> bool:
    """``out[rows] = combiner(out[rows], x[rows, k])`` over the last axis only."""
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    if kinds != [tirx.IterVar.DataPar] * row_axes + [tirx.IterVar.CommReduce]:
        return False
    return isinstance(stmt.body, tirx.BufferStore) and isinstance(stmt.body.value, combiner)


def _reduced_buffer(stmt):
    """The buffer a row reduction reads (not its own accumulator)."""
    accumulator = stmt.writes[0].source
    return next(region.source for region in stmt.reads if not region.source.same_as(accumulator))


def _matmul_operands(stmt):
    product = stmt.body.value.b
    return _load_buffer(product.a), _load_buffer(product.b)


def _load_buffer(expr):
    expr = expr.value if isinstance(expr, tirx.Cast) else expr
    return expr.source if isinstance(expr, TensorLoad) else None


def _key_major(ndim: int) -> tirx.IndexMap:
    """[.., row, col] -> [.., col, row]."""
    return tirx.IndexMap.from_func(lambda *idx: [*idx[:-2], idx[-1], idx[-2]], ndim=ndim)


def _schedule(sch: s_tir.Schedule, parts: _Parts, lanes: int) -> None:
    for block in reversed(parts.merge[1:]):
        sch.reverse_compute_inline(block)
    merge = parts.merge[0] if parts.merge else None
    for block in parts.others:
        sch.compute_inline(block)
    q_tile = parts.q_tile
    if q_tile is None:
        q_tile = sch.cache_read(parts.scores, _matmul_read_index(sch, parts.scores), "global")
    for block in (q_tile, parts.scores, parts.logits, parts.exp, parts.probs):
        if block is not None:
            ndim = len(sch.get(block).writes[0].source.shape)
            sch.transform_layout(block, ("write", 0), _key_major(ndim))

    keys = int(sch.get(parts.scores).iter_vars[-2].dom.extent)
    row = _row_loop(sch, parts.context, keys, lanes)
    for block in (parts.probs, parts.row_sum, parts.exp, parts.row_max, parts.logits, parts.scores,
                  q_tile):
        if block is not None:
            sch.compute_at(block, row, preserve_unit_loops=True)

    _scores_kernel(sch, parts.scores, parts.logits)
    for block in (parts.exp, parts.probs):
        _key_major_elementwise(sch, block)
    for block in (parts.row_max, parts.row_sum):
        _key_major_reduction(sch, block)
    _context_kernel(sch, parts.context, merge, lanes)


def _matmul_read_index(sch: s_tir.Schedule, block) -> int:
    stmt = sch.get(block)
    q_buffer, _ = _matmul_operands(stmt)
    return next(i for i, region in enumerate(stmt.reads) if region.source.same_as(q_buffer))


def _row_loop(sch: s_tir.Schedule, context, keys: int, lanes: int):
    """Split the context's query rows into tiles of R and return the fused parallel loop over
    (batch.., head, row tile); R is two vectors of rows, fewer when the tiles would outgrow L2."""
    *batch, rows, _dim, _keys = sch.get_loops(context)
    budget = max(_TILE_BUDGET_BYTES // (4 * 4 * keys), 1)
    outer, _ = sch.split(rows, [None, _largest_divisor(_extent(sch, rows), min(2 * lanes, budget))])
    row = sch.fuse(*batch, outer)
    sch.parallel(row)
    return row


def _scores_kernel(sch: s_tir.Schedule, block, logits) -> None:
    """scoresᵀ[key, rows] += K[key, d] * Qᵀ[d, rows] on a register tile of keys x row vectors;
    the scale and masks (``logits``) are applied to the tile before it is stored."""
    rows, keys, depth = sch.get_loops(block)[-3:]
    key_outer, key_inner = sch.split(keys, [None, _largest_divisor(_extent(sch, keys), _TILE_KEYS)])
    sch.reorder(key_outer, depth, key_inner, rows)
    sch.unroll(key_inner)
    sch.vectorize(rows)
    epilogue = sch.cache_write(block, 0, "local")
    if logits is not None:
        sch.compute_inline(epilogue)
        epilogue = logits
    sch.reverse_compute_at(epilogue, key_outer, preserve_unit_loops=True)
    _key_major_elementwise(sch, epilogue)
    init = sch.decompose_reduction(block, depth)
    sch.vectorize(sch.get_loops(init)[-1])


def _key_major_elementwise(sch: s_tir.Schedule, block) -> None:
    rows, keys = sch.get_loops(block)[-2:]
    sch.reorder(keys, rows)
    sch.vectorize(rows)


def _key_major_reduction(sch: s_tir.Schedule, block) -> None:
    """Row max/sum as element-wise max/add of row vectors over the keys."""
    rows, keys = sch.get_loops(block)[-2:]
    sch.reorder(keys, rows)
    sch.vectorize(rows)
    init = sch.decompose_reduction(block, keys)
    sch.vectorize(sch.get_loops(init)[-1])


def _context_kernel(sch: s_tir.Schedule, block, merge, lanes: int) -> None:
    """context[rows, d] += probs[rows, key] * V[key, d] on a register tile of rows x head-dim
    vectors, stored by the head merge (``merge``) straight into the [batch, seq, heads*dim] output."""
    rows, dim, keys = sch.get_loops(block)[-3:]
    row_outer, row_inner = sch.split(rows, [None, _largest_divisor(_extent(sch, rows), _TILE_ROWS)])
    dim_extent = _extent(sch, dim)
    dim_tile = next((v * lanes for v in (2, 1) if dim_extent % (v * lanes) == 0),
                    _largest_divisor(dim_extent, 2 * lanes))
    dim_outer, dim_inner = sch.split(dim, [None, dim_tile])
    sch.reorder(row_outer, dim_outer, keys, row_inner, dim_inner)
    sch.unroll(row_inner)
    sch.vectorize(dim_inner)
    store = sch.cache_write(block, 0, "local")
    if merge is not None:
        sch.compute_inline(store)
        store = merge
    sch.reverse_compute_at(store, dim_outer, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(store)[-1])
    init = sch.decompose_reduction(block, keys)
    sch.vectorize(sch.get_loops(init)[-1])


def _extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)
