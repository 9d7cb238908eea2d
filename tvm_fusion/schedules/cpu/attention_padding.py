"""Padding one axis of some blocks of a kernel up to whole tiles, by rewriting the function.

The attention rule runs a symbolic query or key length on whole tiles: schedule primitives keep
a block's domain and would predicate the padding away (every vector step of the tile then
scalar), so the blocks' iterators, loops and buffers are rewritten to the padded extent instead,
their reads of everything else clamped to the last real index.
"""

from __future__ import annotations

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.ir.expr import TensorLoad, TensorRegion

from ...kernels.blocks import among


def rewritten(sch: s_tir.Schedule, parts, func: tirx.PrimFunc):
    """A schedule of the rewritten ``func`` and the same parts in it (found by block name)."""
    new = s_tir.Schedule(func)

    def same(block):
        return None if block is None else new.get_sblock(sch.get(block).name_hint)

    return new, type(parts)(**{field: [same(b) for b in value] if isinstance(value, list) else same(value)
                               for field, value in vars(parts).items()})


def pad_axis(sch: s_tir.Schedule, targets: list, extent: tirx.Expr, tile: int) -> tirx.PrimFunc:
    """The function with one axis of some blocks padded from ``extent`` to whole ``tile``s.

    ``targets`` holds (block, axis of the buffer it writes). Each block's iterator on that axis and
    its root loop get the padded extent, and so do the buffers they write; the blocks' reads of
    any other buffer (the inputs: Q, K, a mask) on that iterator are clamped to ``extent - 1``, so
    the padding repeats the last real row or key. Schedule primitives keep a block's domain and
    would predicate the padding away, hence the rewrite (``tvm_ffi.structural_map``).
    """
    padded = tirx.floordiv(extent + (tile - 1), tile) * tile
    last = extent - 1
    names, iters, old_buffers, new_buffers = [], [], [], []
    for block, axis in targets:
        stmt = sch.get(block)
        buffer, index = stmt.body.buffer, stmt.body.indices[axis]
        shape = list(buffer.shape)
        shape[axis] = padded
        names.append(stmt.name_hint)
        iters.append(index)
        old_buffers.append(buffer)
        new_buffers.append(tirx.decl_buffer(shape, buffer.dtype, buffer.name, scope=buffer.scope()))
    func = sch.mod["main"]
    loops = []  # the root loops bound to the padded iterators

    def find_loops(realize: s_tir.SBlockRealize) -> None:
        if realize.block.name_hint in names:
            it = iters[names.index(realize.block.name_hint)]
            loops.extend(value for iv, value in zip(realize.block.iter_vars, realize.iter_values)
                         if iv.var.same_as(it))

    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, find_loops))

    def is_padded(buffer) -> bool:
        return among(buffer, old_buffers) or among(buffer, new_buffers)

    def clamp_load(load: TensorLoad) -> TensorLoad:
        if is_padded(load.source):
            return load
        return tirx.BufferLoad(load.source, [tirx.min(i, last) if among(i, iters) else i
                                             for i in load.indices])

    def clamp_region(region: TensorRegion) -> TensorRegion:
        if is_padded(region.source):
            return region
        return tirx.BufferRegion(region.source, [
            ir.Range.from_min_extent(tirx.min(r.min, last), r.extent) if among(r.min, iters) else r
            for r in region.region])

    def block(stmt: s_tir.SBlock) -> s_tir.SBlock:
        if stmt.name_hint not in names:
            return stmt
        return tvm_ffi.structural_map(stmt, [(TensorLoad, clamp_load), (TensorRegion, clamp_region)])

    def buffer(buf: tirx.Buffer) -> tirx.Buffer:
        return next((new for old, new in zip(old_buffers, new_buffers) if buf.same_as(old)), buf)

    def iter_var(iv: tirx.IterVar) -> tirx.IterVar:
        if not among(iv.var, iters):
            return iv
        return tirx.IterVar(ir.Range.from_min_extent(0, padded), iv.var, iv.iter_type)

    def loop(stmt: tirx.For) -> tirx.For:
        if not among(stmt.loop_var, loops):
            return stmt
        return tirx.For(stmt.loop_var, stmt.min, padded, stmt.kind, stmt.body, stmt.thread_binding,
                        stmt.annotations)

    return tvm_ffi.structural_map(func, [(s_tir.SBlock, block), (tirx.Buffer, buffer),
                                         (tirx.IterVar, iter_var), (tirx.For, loop)])
