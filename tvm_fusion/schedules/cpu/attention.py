"""Fused attention on CPU: one block of query rows at a time, its scores in a cache-resident tile.

The function FuseTIR makes of an ``attention`` composite computes, over full [.., Sq, Skv]
buffers: scores = Q·Kᵀ, logits = scale/mask(scores), max, exp, sum, probs = exp/sum,
context = probs·V, then the head merge. This rule computes all of it under one parallel loop
over (batch, head, block of R query rows), so every seq x seq intermediate shrinks to an
R x Skv tile that stays in L1/L2; Q, K and V are read straight from the projections (the head
split transposes are inlined; a K the kernel computes, as the dynamo exporter's K * sqrt(scale),
once per task into a tile) and the head merge writes the output in place. A [.., Sq, Skv] mask
the heads share is transposed to key-major once, before the tasks.

The tiles are stored key-major ([Skv, R]), so that every step runs on vectors of R query rows:
the Q·Kᵀ micro-kernel broadcasts K[j, d] against a vector of Qᵀ[d, rows], and the softmax max
and sum become element-wise vector max/add over the key axis, with no horizontal reductions.
The math is the legalized softmax's own (max-subtracted exp), only reordered by loop
transformations, so masked (-inf or dtype-min) and fully-masked rows behave exactly as unfused.
A two-pass row tile is used instead of FlashAttention's online softmax: a schedule cannot change
the arithmetic, and for key lengths up to a few thousand the row tile fits in L2 anyway.

Symbolic query and key lengths (a model compiled once for a range of sequence lengths) run on
whole tiles too. A predicate on the row lanes would make every vector step of the tile scalar, and
``pad_einsum`` cannot help here: the zero-padding selects it puts between the seven blocks have a
vector condition, which scalarizes just the same. So before scheduling, the function is rewritten
(``_pad_queries``): every intermediate from Qᵀ to the context gets its query rows padded up to
whole row tiles, the padding rows reading the last real row of Q (and of a row-wise mask), so they
hold finite values nobody looks at; only the head merge, which writes the output, keeps the real
row count. Keys are padded the same way in the Q·Kᵀ tile and its scale/mask epilogue only
(``_pad_keys``): the max, exp, sum and probs·V blocks still run over the real keys, so a padded
key is never part of any row's softmax and needs no -inf mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_copy, is_spatial, static_product
from ...kernels.matmul import match_matmul
from ...targets.target_info import vector_lanes
from .attention_padding import pad_axis, rewritten
from .helpers import (MIN_VECTOR_PIECE, compute_epilogue_at, cpu_schedule, extent, largest_divisor, power_of_two_width,
                      tile_factor, vectorized_init)
from .small_extent import MIN_PARALLEL_TILE_WORK, serial_when_small

# Bytes of row tiles (scores, logits, exp, probs) one task may keep: half of a 1 MiB L2.
_TILE_BUDGET_BYTES = 512 * 1024
_TILE_KEYS = 8        # keys per register tile of the Q·Kᵀ micro-kernel (x 2 vectors of rows)
_TILE_ROWS = 8        # rows per register tile of the probs·V micro-kernel
_ASSUMED_KEYS = 512   # a symbolic key length, for sizing the row tile


@dataclass
class _Parts:
    """The blocks of a fused attention function, in dataflow order."""

    q_tile: object | None  # producer of the scores' Q operand (a head-split transpose), if any
    k_tile: object | None  # producer of the scores' K operand where it computes (a scale), if any
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

    runs_before = ("MatmulEpilogue", "Softmax")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        parts = None if sch is None else _find_parts(sch)
        if parts is None:
            return None
        dtype = sch.get(parts.context).writes[0].source.dtype
        lanes = vector_lanes(target, str(dtype))
        try:
            _inline_neighbours(sch, parts)
            rows, keys = _lengths(sch, parts)
            row_tile = _row_tile(rows, keys, lanes)
            # Symbolic lengths: pad them to whole tiles first, so no vector step is predicated.
            for symbolic, pad in ((keys, lambda: _pad_keys(sch, parts, _TILE_KEYS)),
                                  (rows, lambda: _pad_queries(sch, parts, row_tile))):
                if not isinstance(symbolic, int):
                    sch, parts = rewritten(sch, parts, pad())
            _schedule(sch, parts, row_tile, lanes)
        except s_tir.ScheduleError:
            return None  # a variant the structural checks did not anticipate: leave it to other rules
        return serial_when_small(sch, MIN_PARALLEL_TILE_WORK)  # short symbolic sequences: one core


def _find_parts(sch: s_tir.Schedule) -> _Parts | None:
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    stmts = [sch.get(block) for block in blocks]
    reductions = [i for i, stmt in enumerate(stmts) if not is_spatial(stmt)]
    if len(reductions) != 4:
        return None
    i_scores, i_max, i_sum, i_context = reductions
    scores, context = stmts[i_scores], stmts[i_context]
    if match_matmul(scores) is None or match_matmul(context) is None:
        return None
    if not isinstance(context.iter_vars[-2].dom.extent, tirx.IntImm):
        return None  # a symbolic head dim: the probs·V tile is vectors of it
    row_axes = len(scores.iter_vars) - 2  # batch.., query row
    if not (_is_row_reduction(stmts[i_max], tirx.Max, row_axes)
            and _is_row_reduction(stmts[i_sum], tirx.Add, row_axes)):
        return None

    writers = {stmt.writes[0].source: i for i, stmt in enumerate(stmts)}
    q_buffer, k_buffer = _matmul_operands(scores)
    probs_buffer, _ = _matmul_operands(context)
    i_logits = writers.get(_reduced_buffer(stmts[i_max]))
    i_exp = writers.get(_reduced_buffer(stmts[i_sum]))
    i_probs = writers.get(probs_buffer)
    i_q = writers.get(q_buffer)
    i_k = writers.get(k_buffer)
    if i_k is not None and is_copy(stmts[i_k]):  # a head split, inlined instead
        i_k = None
    if i_logits is None or i_exp is None or i_probs is None:
        return None
    if not (i_scores <= i_logits < i_max < i_exp < i_sum < i_probs < i_context):
        return None
    kept = {i_scores, i_logits, i_max, i_exp, i_sum, i_probs, i_context, i_q, i_k}
    return _Parts(
        q_tile=blocks[i_q] if i_q is not None else None,
        k_tile=blocks[i_k] if i_k is not None else None,
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


def _inline_neighbours(sch: s_tir.Schedule, parts: _Parts) -> None:
    """Inline the head merge's reshapes into its first block, and the head split, scale and mask
    blocks into the blocks of the chain that read them."""
    for block in reversed(parts.merge[1:]):
        sch.reverse_compute_inline(block)
    for block in parts.others:
        sch.compute_inline(block)
    parts.merge, parts.others = parts.merge[:1], []


def _lengths(sch: s_tir.Schedule, parts: _Parts) -> tuple:
    """Query rows and keys of the scores, each an int when static, else the symbolic expression."""
    *_, rows, keys, _depth = (iv.dom.extent for iv in sch.get(parts.scores).iter_vars)
    return tuple(int(e) if isinstance(e, tirx.IntImm) else e for e in (rows, keys))


def _row_tile(rows, keys, lanes: int) -> int:
    """Query rows per task: two vectors of rows, fewer when the tiles would outgrow L2; for a
    static row count, the largest divisor of it up to that (no remainder tile), or where that
    is not whole vectors, the widest power-of-two vector dividing it: the tile's rows are the
    vector of every step, and one LLVM vector of 20 rows (PP-OCRv4-rec's 40) runs as an odd
    width (see ``vectorize_in_registers``)."""
    budget = max(_TILE_BUDGET_BYTES // (4 * 4 * (keys if isinstance(keys, int) else _ASSUMED_KEYS)), 1)
    limit = min(2 * lanes, budget)
    if not isinstance(rows, int):
        return limit
    tile = largest_divisor(rows, limit)
    width = power_of_two_width(rows, lanes)
    if tile % lanes and MIN_VECTOR_PIECE <= width <= limit:
        return width
    return tile


def _pad_queries(sch: s_tir.Schedule, parts: _Parts, tile: int) -> tirx.PrimFunc:
    """Pad the query rows of every block from Qᵀ to the context (not the head merge) up to whole
    row tiles; see the module docstring."""
    chain = [parts.q_tile, parts.scores, parts.logits, parts.row_max, parts.exp, parts.row_sum,
             parts.probs, parts.context]
    rows, _ = _lengths(sch, parts)
    reductions = (parts.row_max, parts.row_sum)  # out[.., row]; every other block: out[.., row, x]
    return pad_axis(sch, [(b, -1 if b in reductions else -2) for b in chain if b is not None], rows, tile)


def _pad_keys(sch: s_tir.Schedule, parts: _Parts, tile: int) -> tirx.PrimFunc:
    """Pad the keys of the Q·Kᵀ tile and its scale/mask epilogue up to whole key tiles; the
    softmax and probs·V blocks still read only the real keys."""
    _, keys = _lengths(sch, parts)
    return pad_axis(sch, [(b, -1) for b in (parts.scores, parts.logits) if b is not None], keys, tile)


def _schedule(sch: s_tir.Schedule, parts: _Parts, row_tile: int, lanes: int) -> None:
    merge = parts.merge[0] if parts.merge else None
    q_tile = parts.q_tile
    if q_tile is None:
        q_tile = sch.cache_read(parts.scores, _matmul_read_index(sch, parts.scores), "global")
    for block in (q_tile, parts.k_tile, parts.scores, parts.logits, parts.exp, parts.probs):
        if block is not None:
            ndim = len(sch.get(block).writes[0].source.shape)
            sch.transform_layout(block, ("write", 0), _key_major(ndim))
    _read_padded_keys(sch, parts)

    row = _row_loop(sch, parts.context, row_tile)
    for block in (parts.probs, parts.row_sum, parts.exp, parts.row_max, parts.logits, parts.scores,
                  q_tile, parts.k_tile):
        if block is not None:
            sch.compute_at(block, row, preserve_unit_loops=True)
    if parts.k_tile is not None:
        _key_major_elementwise(sch, parts.k_tile)

    _scores_kernel(sch, parts.scores, parts.logits)
    _transposed_masks(sch, parts, lanes)  # after the tiles: reverse_compute_at wants every producer under them
    for block in (parts.exp, parts.probs):
        _key_major_elementwise(sch, block)
    for block in (parts.row_max, parts.row_sum):
        _key_major_reduction(sch, block)
    _context_kernel(sch, parts.context, merge, lanes)


def _read_padded_keys(sch: s_tir.Schedule, parts: _Parts) -> None:
    """When the keys of the logits were padded (``_pad_keys``), declare that the row max and the
    exp read all of them. They still loop over the real keys only; the wider region is what
    makes compute_at give the Q·Kᵀ tile and its epilogue the padded key count: whole 8-key
    register tiles, no predicate."""
    logits = sch.get(parts.logits or parts.scores).writes[0].source
    padded_keys = logits.shape[-2]  # key-major: [.., key, row]
    for block in (parts.row_max, parts.exp):
        stmt = sch.get(block)
        if tvm_ffi.structural_equal(stmt.iter_vars[-1].dom.extent, padded_keys):
            continue  # static keys: nothing was padded
        index, region = next((i, r) for i, r in enumerate(stmt.reads) if r.source.same_as(logits))
        ranges = [(r.min, r.min + r.extent) for r in region.region]
        ranges[-2] = (0, padded_keys)
        sch.annotate_buffer_access(block, index, "read", lambda *_: ranges)


def _transposed_masks(sch: s_tir.Schedule, parts: _Parts, lanes: int) -> None:
    """Copy each [.., row, key] mask that the heads (or the batch) share into a key-major
    buffer once, before the tasks. Read in place, every task gathered its rows' mask one scalar at
    a time into the key-major logits tile (minilm-l6: a fifth of the kernel's time); copied, each
    element is transposed once, not once per head, and the tiles read it as row vectors."""
    if parts.logits is None:
        return
    stmt = sch.get(parts.logits)
    scores = sch.get(parts.scores).writes[0].source
    logits_size = static_product(stmt.writes[0].source.shape)
    masks = [i for i, region in enumerate(stmt.reads)
             if not region.source.same_as(scores) and _shared_mask(region.source.shape, logits_size)]
    for index in reversed(masks):  # a copy's read index shifts the later ones
        copy = sch.cache_read(parts.logits, index, "global")
        sch.transform_layout(copy, ("write", 0), _key_major(len(sch.get(copy).writes[0].source.shape)))
        *outer, rows, keys = sch.get_loops(copy)
        sch.reorder(keys, rows)
        sch.parallel(sch.fuse(*outer, keys))
        piece = largest_divisor(extent(sch, rows), lanes)
        if piece > 1:  # rows gathered a vector at a time, stored contiguously
            sch.vectorize(sch.split(rows, [None, piece])[1])


def _shared_mask(shape, logits_size: int | None) -> bool:
    """A static [.., rows, keys] buffer (both > 1) smaller than the logits: read by several heads."""
    size = static_product(shape)
    return (len(shape) >= 2 and size is not None and logits_size is not None and size < logits_size
            and int(shape[-1]) > 1 and int(shape[-2]) > 1)


def _matmul_read_index(sch: s_tir.Schedule, block) -> int:
    stmt = sch.get(block)
    q_buffer, _ = _matmul_operands(stmt)
    return next(i for i, region in enumerate(stmt.reads) if region.source.same_as(q_buffer))


def _row_loop(sch: s_tir.Schedule, context, row_tile: int):
    """Split the context's query rows into tiles and return the fused parallel loop over
    (batch.., head, row tile)."""
    *batch, rows, _dim, _keys = sch.get_loops(context)
    outer, _ = sch.split(rows, [None, row_tile])
    row = sch.fuse(*batch, outer)
    sch.parallel(row)
    return row


def _scores_kernel(sch: s_tir.Schedule, block, logits) -> None:
    """scoresᵀ[key, rows] += K[key, d] * Qᵀ[d, rows] on a register tile of keys x row vectors;
    the scale and masks (``logits``) are applied to the tile before it is stored."""
    rows, keys, depth = sch.get_loops(block)[-3:]
    key_outer, key_inner = sch.split(keys, [None, tile_factor(sch.get(keys).extent, _TILE_KEYS)])
    sch.reorder(key_outer, depth, key_inner, rows)
    sch.unroll(key_inner)
    sch.vectorize(rows)
    epilogue = compute_epilogue_at(sch, block, [] if logits is None else [logits], key_outer)
    _key_major_elementwise(sch, epilogue)
    vectorized_init(sch, block, depth)


def _key_major_elementwise(sch: s_tir.Schedule, block) -> None:
    rows, keys = sch.get_loops(block)[-2:]
    sch.reorder(keys, rows)
    sch.vectorize(rows)


def _key_major_reduction(sch: s_tir.Schedule, block) -> None:
    """Row max/sum as element-wise max/add of row vectors over the keys."""
    keys = sch.get_loops(block)[-1]
    _key_major_elementwise(sch, block)
    vectorized_init(sch, block, keys)


def _context_kernel(sch: s_tir.Schedule, block, merge, lanes: int) -> None:
    """context[rows, d] += probs[rows, key] * V[key, d] on a register tile of rows x head-dim
    vectors, stored by the head merge (``merge``) straight into the [batch, seq, heads*dim] output."""
    rows, dim, keys = sch.get_loops(block)[-3:]
    row_outer, row_inner = sch.split(rows, [None, tile_factor(sch.get(rows).extent, _TILE_ROWS)])
    dim_extent = extent(sch, dim)
    dim_tile = next((v * lanes for v in (2, 1) if dim_extent % (v * lanes) == 0),
                    tile_factor(sch.get(dim).extent, 2 * lanes))
    dim_outer, dim_inner = sch.split(dim, [None, dim_tile])
    sch.reorder(row_outer, dim_outer, keys, row_inner, dim_inner)
    sch.unroll(row_inner)
    sch.vectorize(dim_inner)
    store = compute_epilogue_at(sch, block, [] if merge is None else [merge], dim_outer)
    sch.vectorize(sch.get_loops(store)[-1])
    vectorized_init(sch, block, keys)
