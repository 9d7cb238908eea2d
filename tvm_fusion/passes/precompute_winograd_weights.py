"""PrecomputeWinogradWeights: a Winograd conv's transformed weight ``U = G g G^T`` computed at
build time.

The legalized Winograd conv (``winograd_conv2d_nchwc``) transforms its weight in the kernel,
because inside a fused composite the weight is a parameter. An inference model's weight is a
constant, so where every call passes one, the transform is done once, with numpy in float64
(``weight_transform``): the ``winograd_weight`` block is dropped, the buffer it wrote becomes
the parameter, and every call passes the transformed constant. Without this, each call would
write and read (m+2)^2 / 9 times the weight's bytes (4x for F(4x4, 3x3)).

It runs first in the schedule phase, with the matmul weight packing, and before the tuning
log and the hand schedules, which then see the kernel that runs.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target

from ..kernels.blocks import unscheduled_kernels
from ..kernels.winograd_conv2d import WINOGRAD_WEIGHT, is_winograd_block, weight_transform
from .kernel_constants import (ConstantRewrite, calls_by_kernel, constant_at_every_call, rewrite_kernels,
                               without_root_statements)


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.PrecomputeWinogradWeights")
class PrecomputeWinogradWeights:
    """Transform the constant weight of every Winograd conv kernel at build time."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        calls = calls_by_kernel(mod)
        rewrites = {}
        for gvar, func, _ in unscheduled_kernels(mod, self.target):
            block = _weight_block(func)
            if block is None:
                continue
            weight = block.reads[0].source
            param = next(i for i, p in enumerate(func.params) if p.same_as(weight))
            if constant_at_every_call(calls.get(gvar, []), param):
                tile = int(block.writes[0].source.shape[0]) - 2
                rewrites[gvar.name_hint] = ConstantRewrite(_weight_as_parameter(func, block), param, ("winograd", tile),
                                                           functools.partial(weight_transform, tile=tile))
        return rewrite_kernels(mod, rewrites)


def _weight_block(func: tirx.PrimFunc) -> s_tir.SBlock | None:
    """The ``winograd_weight`` block of ``func`` when it reads one parameter, else None."""
    blocks = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda block: blocks.append(block)
                                        if is_winograd_block(block.name_hint, WINOGRAD_WEIGHT) else None))
    if len(blocks) != 1 or len(blocks[0].reads) != 1:
        return None
    (block,) = blocks
    return block if any(block.reads[0].source.same_as(param) for param in func.params) else None


def _weight_as_parameter(func: tirx.PrimFunc, block: s_tir.SBlock) -> tirx.PrimFunc:
    """``func`` without ``block``; the buffer ``block`` wrote takes the place of the parameter it read."""
    transformed, weight = block.writes[0].source, block.reads[0].source
    body = without_root_statements(func.body, lambda stmt: _contains(stmt, block), transformed.same_as)
    params = [transformed if param.same_as(weight) else param for param in func.params]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def _contains(stmt, block: s_tir.SBlock) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, (s_tir.SBlock, lambda other: found.append(other) if other.same_as(block) else None))
    return bool(found)


__all__ = ["PrecomputeWinogradWeights"]
