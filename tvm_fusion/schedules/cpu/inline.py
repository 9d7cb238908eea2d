"""Inline the cheap element-wise blocks (casts, copies, reshapes, arithmetic) into their consumers."""

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.s_tir.dlight.analysis import get_root_block


def inline_cheap_blocks(sch: s_tir.Schedule) -> None:
    """Inline every spatial block without math calls into its consumers.

    Blocks that call exp, erf, rsqrt... are kept, because inlining them into several
    consumers or a larger loop nest would recompute the call per use.
    """
    for block in sch.get_child_blocks(get_root_block(sch)):
        stmt = sch.get(block)
        if not is_spatial(stmt) or _has_call(stmt.body):
            continue
        try:
            sch.compute_inline(block)
        except s_tir.ScheduleError:
            continue  # an output block, or one whose consumers cannot take it


def is_spatial(block: s_tir.SBlock) -> bool:
    """True if every axis of the block is data-parallel (no reduction)."""
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)


def only_reduction(sch: s_tir.Schedule) -> tuple[list, int] | None:
    """The root's blocks and the index of its one reduction block; None unless exactly one."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = [i for i, block in enumerate(blocks) if not is_spatial(sch.get(block))]
    return (blocks, reductions[0]) if len(reductions) == 1 else None


def one_reduction_kernel(func, target) -> tuple[s_tir.Schedule, list, int] | None:
    """For a CPU PrimFunc: a schedule with the cheap blocks inlined, its root blocks and the
    index of its one reduction block (a conv, a pool); None for other targets and kernels."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    sch = s_tir.Schedule(func)
    inline_cheap_blocks(sch)
    found = only_reduction(sch)
    return None if found is None else (sch, *found)


def has_static_extents(*blocks: s_tir.SBlock) -> bool:
    """True if every axis of every block has a constant extent (tile factors can be chosen)."""
    return all(isinstance(iv.dom.extent, tirx.IntImm) for block in blocks for iv in block.iter_vars)


def extent_of(extent: tirx.Expr) -> int | tirx.Expr:
    """An extent as an int when it is constant, else the symbolic expression (``n``, ``n * 4``)."""
    return int(extent) if isinstance(extent, tirx.IntImm) else extent


def same_extents(a: list, b: list) -> bool:
    """True if two lists of extents (ints or symbolic expressions) are equal element-wise."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else tvm_ffi.structural_equal(x, y)
        for x, y in zip(a, b)
    )


def iter_kinds(block: s_tir.SBlock) -> str:
    """The block's axes as a string, "S" per spatial and "R" per reduction axis."""
    return "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in block.iter_vars)


def _has_call(stmt) -> bool:
    calls = []
    tvm_ffi.structural_walk(stmt, (Call, calls.append))
    return bool(calls)
