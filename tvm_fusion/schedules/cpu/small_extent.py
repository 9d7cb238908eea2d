"""Run a parallel loop of symbolic extent serially when, at run time, it has too little work.

A static rule leaves a small loop nest serial (``Injective`` below 4096 elements, a single row),
because waking the thread pool costs several microseconds, more than the loop itself. A loop
whose extent is a sequence length ``n`` cannot decide that when it is scheduled, so this helper
decides it when the kernel runs: each such loop nest becomes

    if work(n) < min_work:   the nest, its outer loop serial    (no thread launch)
    else:                    the nest as scheduled, in parallel

where ``work`` is the number of block iterations the nest runs (its elements, for an
element-wise kernel). Both copies keep the same vectors, tiles and unrolling. The serial copy
gets fresh loop, block and buffer definitions (a scratch buffer the nest allocates is private to
each copy), so the function stays well formed and each copy's scratch stays inside its loops.
"""

from __future__ import annotations

from math import prod

import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer
from tvm.tirx import ForKind
from tvm.tirx.buffer import is_buffer_var
from tvm_ffi.structural import DefRegionKind

from ...kernels.blocks import among, is_static


# Below this many scalar block iterations (elements of an element-wise kernel, rows x row length
# of a norm) a thread launch costs more than the loop: the threshold the static Injective rule uses.
MIN_PARALLEL_ELEMENTS = 4096
# Register-tiled matmul and attention kernels count one multiply-add per iteration, ~20 of them a
# nanosecond: serial up to this many (a 16 x 128 x 128 matmul), where it measured as fast as the launch.
MIN_PARALLEL_TILE_WORK = 1 << 18
# Multiply-adds up to which a static matmul runs on one core: sharing it costs more than it
# saves (a recurrent step's 1 x 128 x 256 product). Lower than serial_when_small's bar for a
# symbolic size, which was set on a kernel timed alone: inside a model the other threads are
# still awake from the kernel before, and a step's 1 x 128 x 512 product gains from them.
MAX_SERIAL_STATIC_WORK = 1 << 15


def is_small_static_sum(block: s_tir.SBlock) -> bool:
    """Whether a sum's iterations (multiply-adds) are static and at most MAX_SERIAL_STATIC_WORK."""
    extents = [iv.dom.extent for iv in block.iter_vars]
    return all(is_static(e) for e in extents) and prod(int(e) for e in extents) <= MAX_SERIAL_STATIC_WORK


def serial_when_small(sch: s_tir.Schedule, min_work: int, static_tasks: bool = False) -> s_tir.Schedule:
    """``sch``'s function with each outermost parallel loop of symbolic extent guarded by a
    run-time test, ``work < min_work``, that selects a serial copy of its nest; with
    ``static_tasks``, also a parallel loop of constant extent (a fixed number of tasks) over
    symbolic work.

    Returns ``sch`` itself when no loop qualifies (static kernels stay as scheduled), else a new
    schedule of the rewritten function.
    """
    func = sch.mod["main"]
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return sch
    root = realize.block
    stmts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    analyzer = Analyzer()

    def guarded(stmt) -> bool:
        return _is_symbolic_parallel(stmt) or (static_tasks and _is_parallel_over_symbolic_work(stmt, analyzer))

    if not any(guarded(stmt) for stmt in stmts):
        return sch
    body, scratch = [], list(root.alloc_buffers)
    for i, stmt in enumerate(stmts):
        if not guarded(stmt):
            body.append(stmt)
            continue
        work = analyzer.simplify(_work(stmt, tirx.IntImm("int64", 1)))
        if _smallest(work, analyzer) >= min_work:
            # Never small (a 256 x 256 matmul's single row tile). The test would also let the
            # simplifier prove the serial copy's tile count zero and fold a modulo by it.
            body.append(stmt)
            continue
        elsewhere = _buffers_in(stmts[:i] + stmts[i + 1:])
        private = [buf for buf in root.alloc_buffers if not among(buf, elsewhere)]
        serial, fresh = _serial_copy(stmt, private)
        scratch.extend(fresh)
        body.append(tirx.IfThenElse(work < tirx.IntImm("int64", min_work), serial, stmt))
    new_root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                            body[0] if len(body) == 1 else tirx.SeqStmt(body), root.init, scratch,
                            root.match_buffers, root.annotations)
    new_func = func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_root))
    return s_tir.Schedule(new_func)


def _is_symbolic_parallel(stmt) -> bool:
    return (isinstance(stmt, tirx.For) and stmt.kind == ForKind.PARALLEL
            and not isinstance(stmt.extent, tirx.IntImm))


def _is_parallel_over_symbolic_work(stmt, analyzer: Analyzer) -> bool:
    return (isinstance(stmt, tirx.For) and stmt.kind == ForKind.PARALLEL
            and not isinstance(analyzer.simplify(_work(stmt, tirx.IntImm("int64", 1))), tirx.IntImm))


def _work(stmt, outer: tirx.Expr) -> tirx.Expr:
    """Block iterations run by ``stmt`` when it runs ``outer`` times: the sum over its blocks of
    the product of the loop extents around each."""
    if isinstance(stmt, tirx.For):
        return _work(stmt.body, outer * tirx.Cast("int64", stmt.extent))
    if isinstance(stmt, tirx.SeqStmt):
        total = tirx.IntImm("int64", 0)
        for child in stmt.seq:
            total = total + _work(child, outer)
        return total
    if isinstance(stmt, tirx.IfThenElse):
        work = _work(stmt.then_case, outer)
        return work if stmt.else_case is None else work + _work(stmt.else_case, outer)
    if isinstance(stmt, s_tir.SBlockRealize):
        return outer
    body = getattr(stmt, "body", None)
    return _work(body, outer) if isinstance(body, tirx.Stmt) else tirx.IntImm("int64", 0)


def _smallest(work: tirx.Expr, analyzer: Analyzer) -> int:
    """``work`` with every symbolic extent at 1 (its least value); 0 if that does not fold."""
    at_one = tvm_ffi.structural_map(work, (tirx.Var, lambda var: tirx.IntImm(var.ty.dtype, 1)))
    least = analyzer.simplify(at_one)
    return int(least) if isinstance(least, tirx.IntImm) else 0


def _serial_copy(loop: tirx.For, private: list) -> tuple[tirx.For, list]:
    """A copy of ``loop`` with its outer loop serial, every loop, block iterator and block-local
    buffer defined anew, and the ``private`` root buffers replaced by fresh ones (returned)."""
    holder = s_tir.SBlock([], [], [], "serial_copy", loop, None, private)
    defined = []

    def collect(var, kind):
        if kind != DefRegionKind.NONE and not among(var, defined):
            defined.append(var)

    tvm_ffi.structural_walk(holder, with_def_region_kind=((tirx.Var,), collect))
    # A buffer is a Var of BufferType: one fresh Var of the same type renews either kind.
    fresh = [tirx.Var(var.name, var.ty) for var in defined]

    def renew(var):
        return next((new for old, new in zip(defined, fresh) if var.same_as(old)), var)

    holder = tvm_ffi.structural_map(holder, (tirx.Var, renew))
    copy = holder.body
    serial = tirx.For(copy.loop_var, copy.min, copy.extent, ForKind.SERIAL, copy.body,
                      copy.thread_binding, copy.annotations)
    return serial, list(holder.alloc_buffers)


def _buffers_in(stmts: list) -> list:
    found = []

    def visit(var) -> None:
        if is_buffer_var(var):
            found.append(var)

    for stmt in stmts:
        tvm_ffi.structural_walk(stmt, (tirx.Var, visit))
    return found
