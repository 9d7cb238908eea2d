"""Tiles of output columns when no tile divides the width: a symbolic width (a model compiled
for a range of sizes), or a static one like 13 or 52 that whole vectors do not divide.

A split by a tile that may not divide the width leaves a predicate on every block under the
tile loop: the vectorizer then scalarizes the tile and the accumulator tile no longer fits
registers. Instead every tile here is full: the last one of a row is shifted back to end at
the row's end (``start = min(x_outer * tile, width - tile)``), so it recomputes a few columns
its neighbour already wrote, with the same values. That needs ``width >= tile``, so the rule
is scheduled once per tile width (widest first, down to single columns) and the kernel picks
the widest that fits at run time. Only spatial writes may overlap: a block under the tile loop
recomputes its output from inputs, it never accumulates into memory outside the tile.

A static width needs one copy: the tile is chosen (``overlapped_tile``) to compute the fewest
columns, and only ``width >= tile`` widths take it.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ...kernels.blocks import is_static

# The narrowest vector tile worth a copy of the kernel: an SSE/NEON register of float32.
MIN_VECTOR_TILE = 4


def static_except(block: s_tir.SBlock, symbolic: tuple[int, ...]) -> bool:
    """True if every axis of ``block`` has a constant extent, except those at ``symbolic``
    (the output rows and columns a symbolic image size reaches)."""
    return all(is_static(iv.dom.extent) for index, iv in enumerate(block.iter_vars) if index not in symbolic)


def width_tiles(widest: int, lanes: int) -> list[int]:
    """Tile widths tried at run time, widest first: ``widest``, then whole vectors halving down
    to ``MIN_VECTOR_TILE``, then single columns."""
    tiles = [widest]
    tile = min(widest // 2, lanes) if widest > lanes else widest // 2
    while tile >= MIN_VECTOR_TILE:
        if tile < tiles[-1]:
            tiles.append(tile)
        tile //= 2
    return tiles + [1]


def overlapped_tile(width: int, tiles: list[int]) -> int:
    """Of ``tiles`` (widest first), the one that computes the fewest columns over a static
    ``width`` when the last tile is shifted back: ``ceil(width / tile) * tile``; ties go to the
    wider tile. Tiles wider than the row are skipped; 1 if all are."""
    fitting = [tile for tile in tiles if tile <= width]
    return min(fitting, key=lambda tile: -(-width // tile) * tile) if fitting else 1


def schedule_static_width(sch: s_tir.Schedule, width: int, tile: int,
                          schedule: Callable[[s_tir.Schedule, int], object]) -> s_tir.Schedule | None:
    """``schedule(sch, tile)`` at a static ``width``; when ``tile`` does not divide it, the last
    tile of each row shifted back instead of predicated. None when ``schedule`` declines."""
    outer = schedule(sch, tile)
    if outer is None:
        return None
    if width % tile == 0:
        return sch
    outer = sch.get(outer).loop_var
    return s_tir.Schedule(_overlap_last_tile(sch.mod["main"], outer, tile, tirx.IntImm(outer.ty.dtype, width)))


def schedule_by_width(func: tirx.PrimFunc, width: tirx.PrimExpr, tiles: list[int],
                      schedule: Callable[[s_tir.Schedule, int], object]) -> s_tir.Schedule | None:
    """One copy of ``func`` per tile width, each scheduled by ``schedule(sch, tile)`` (which
    splits the column loop ``[None, tile]`` and returns the outer column loop, or None to
    decline), the last tile of each row shifted back; the copies are chained by
    ``if width >= tile`` so each call runs the widest tiles that fit."""
    bodies = []
    for tile in tiles:
        sch = s_tir.Schedule(func)
        outer = schedule(sch, tile)
        if outer is None:
            return None
        scheduled = sch.mod["main"]
        if tile > 1:
            scheduled = _overlap_last_tile(scheduled, sch.get(outer).loop_var, tile, width)
        # Each copy gets its own loop variables and buffers (the copies are one function).
        bodies.append((tile, _renew_loop_vars(scheduled)))
    # A loop_partition leaves its copies of a block sharing iteration variables; the chained
    # function is verified as a new schedule, which wants each defined once.
    chained = _unique_block_vars(_chain(func, width, bodies))
    return s_tir.Schedule(tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": chained}))["main"])


def _overlap_last_tile(func: tirx.PrimFunc, outer: tirx.Var, tile: int, width) -> tirx.PrimFunc:
    """Start column ``outer * tile`` -> ``min(outer * tile, width - tile)`` (and a multiple of
    it likewise); the split's
    predicates (all that mention ``outer``) are dropped, as every tile is now inside the row."""
    start = tirx.Min(outer * tile, width - tile)

    def column(mul):
        # ``outer * (k * tile)``: the start of the tile in a map k times as wide (the output
        # columns of a stride-k transposed conv tiled by input column).
        if mul.a.same_as(outer) and isinstance(mul.b, tirx.IntImm) and int(mul.b) % tile == 0:
            return start if int(mul.b) == tile else start * (int(mul.b) // tile)
        return mul

    body = tvm_ffi.structural_map(without_predicates_on(func.body, outer), [(tirx.Mul, column)])
    return func.with_body(body)


def without_predicates_on(stmt, var: tirx.Var):
    """``stmt`` with every block predicate that mentions ``var`` dropped: a split's bounds
    checks, once each tile of ``var`` is shifted to lie inside the extent."""
    def realize(node):
        if is_static(node.predicate) or not mentions(node.predicate, var):
            return node
        return s_tir.SBlockRealize(node.iter_values, True, node.block)

    return tvm_ffi.structural_map(stmt, [(s_tir.SBlockRealize, realize)])


def _renew_loop_vars(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with fresh loop and block iteration variables (its parameters and buffers
    kept), so that copies of one function can sit side by side in one body."""
    defined = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: defined.append(loop.loop_var)),
                                        (s_tir.SBlock, lambda b: defined.extend(iv.var for iv in b.iter_vars))])
    fresh = {var: tirx.Var(var.name, var.ty) for var in defined}
    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.Var, lambda v: fresh.get(v, v))]))


def _unique_block_vars(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Fresh iteration variables for every block (ConvertSSA renames loop variables only)."""

    def rename(block):
        fresh = {iv.var: tirx.Var(iv.var.name, iv.var.ty) for iv in block.iter_vars}
        return tvm_ffi.structural_map(block, [(tirx.Var, lambda v: fresh.get(v, v))])

    return func.with_body(tvm_ffi.structural_map(func.body, [(s_tir.SBlock, rename)]))


def mentions(expr, var: tirx.Var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v) if v.same_as(var) else None))
    return bool(found)


def _chain(func: tirx.PrimFunc, width, bodies: list) -> tirx.PrimFunc:
    """``if width >= tiles[0]: copy0 elif width >= tiles[1]: copy1 ... else: last copy`` under
    one root block holding every copy's buffers."""
    roots = [scheduled.body.block for _, scheduled in bodies]
    stmt = roots[-1].body
    for (tile, _), root in zip(reversed(bodies[:-1]), reversed(roots[:-1])):
        stmt = tirx.IfThenElse(width >= tile, root.body, stmt)
    buffers = []
    for root in roots:
        buffers += [b for b in root.alloc_buffers if not any(b.same_as(seen) for seen in buffers)]
    first = roots[0]
    root = s_tir.SBlock(first.iter_vars, first.reads, first.writes, first.name_hint, stmt,
                        alloc_buffers=buffers, annotations=first.annotations)
    return bodies[0][1].with_body(s_tir.SBlockRealize([], True, root))
