"""Reading a kernel (a PrimFunc) as the passes that rewrite kernels and the CPU schedule rules
both read it: the module's kernels not yet scheduled, a CPU kernel, static extents, spatial
blocks, and the one reduction block of a kernel with the blocks around it.

Below ``passes/`` and ``schedules/``: a pass that must take exactly the kernels a rule schedules
(``PackMatmulWeights``, ``PrecomputeWinogradWeights``) reads them with the rule's own helpers,
from here, and depends on no schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target


def unscheduled_kernels(mod: tvm.IRModule, target: Target):
    """(GlobalVar, PrimFunc, its target) for every PrimFunc of ``mod`` not yet marked
    ``tirx.is_scheduled``; a function's own ``target`` attribute wins over ``target``."""
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
            yield gvar, func, func.attrs.get("target", target) if func.attrs else target


def is_cpu_kernel(func, target: Target) -> bool:
    """True if ``func`` is a PrimFunc compiled for a CPU (LLVM) target."""
    return isinstance(func, tirx.PrimFunc) and target.kind.name == "llvm"


def is_static(expr) -> bool:
    return isinstance(expr, tirx.IntImm)


def static_product(exprs) -> int | None:
    """The product of ``exprs`` (extents, a shape) when all are static, else None."""
    exprs = list(exprs)
    return math.prod(int(e) for e in exprs) if all(is_static(e) for e in exprs) else None


def is_copy(block: s_tir.SBlock) -> bool:
    """A block that only loads (and casts) another buffer: a transpose, a reshape."""
    value = getattr(block.body, "value", None)
    if isinstance(value, tirx.Cast):
        value = value.value
    return isinstance(value, tvm.ir.TensorLoad)


def is_spatial(block: s_tir.SBlock) -> bool:
    """True if every axis of the block is data-parallel (no reduction)."""
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)


def among(obj, objs) -> bool:
    """True if ``obj`` is the same object as one of ``objs``."""
    return any(obj.same_as(other) for other in objs)


def indices_are(indices, variables) -> bool:
    """True if ``indices`` are exactly ``variables``, in order."""
    return len(indices) == len(variables) and all(
        index.same_as(var) for index, var in zip(indices, variables)
    )


@dataclass
class OneReduction:
    """A kernel's schedule and its root blocks around its only reduction block (a conv, a pool,
    a matmul); all the others are spatial."""

    sch: s_tir.Schedule
    prologue: list
    block: object
    epilogue: list

    @property
    def stmt(self) -> s_tir.SBlock:
        return self.sch.get(self.block)


def only_reduction(sch: s_tir.Schedule) -> OneReduction | None:
    """The root's blocks around its one reduction block; None unless there is exactly one."""
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    reductions = [i for i, block in enumerate(blocks) if not is_spatial(sch.get(block))]
    if len(reductions) != 1:
        return None
    (index,) = reductions
    return OneReduction(sch, blocks[:index], blocks[index], blocks[index + 1:])
