"""PackMatmulWeights: a constant matmul weight stored as column panels, [N/P, K, P], at build time.

The CPU matmul kernel computes a tile of output columns from a K x P panel of the weight.
Read from the [K, N] matrix, the panel's rows lie N floats apart: every k starts a new cache
line and, for a wide N, a new page, and the accesses alias in a few cache sets, so the panel
never stays in cache. A 32 x 1024 x 8192 matmul ran at 15 GFLOP/s that way and at 50 packed
(Zen 3, 2 threads); a 1 x 512 x 2048 step of an LSTM at 4.5 and 9.6.

The weight of an inference model is a constant, so it is packed once, here, with numpy: the
kernel's parameter takes the panel layout (``transform_layout``) and every call passes the
packed constant. A width that P does not divide is padded with zero columns: the kernel
computes whole panels and its epilogue stores only the real columns.

This runs first in the schedule phase, before the tuning log is applied, and when tuning
tasks are extracted (``tuning/tasks.py``): MetaSchedule tunes the packed kernel that compile
runs. It takes only kernels MatmulEpilogue schedules (``kernels/matmul.py``: ``weight_parameter``),
in panels as wide as that rule's column tile (``MATMUL_TILE_VECTORS`` vectors).
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.target import Target

from ..kernels.blocks import only_reduction, unscheduled_kernels
from ..kernels.matmul import MATMUL_TILE_VECTORS, WeightParameter, weight_parameter
from ..targets.target_info import vector_lanes
from .kernel_constants import (ConstantRewrite, calls_by_kernel, constant_at_every_call, rewrite_kernels,
                               without_root_statements)

_PAD_CHECK_SUFFIX = "_assumptions"
# Zero columns, as a share of the real ones, that a width off the panel may be padded with.
_MAX_PANEL_PADDING = 1 / 8


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.PackMatmulWeights")
class PackMatmulWeights:
    """Pack the constant weight of every matmul kernel whose every call passes it as a constant."""

    def __init__(self, target: Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        calls = calls_by_kernel(mod)
        rewrites = {}
        for gvar, func, target in unscheduled_kernels(mod, self.target):
            weight = weight_parameter(func, target)
            panel = None if weight is None else _panel(weight, target)
            if panel is None:
                continue
            param = weight.param
            if constant_at_every_call(calls.get(gvar, []), param):
                rewrites[gvar.name_hint] = ConstantRewrite(_packed_kernel(func, param, panel), param, ("panel", panel),
                                                           functools.partial(pack_columns, panel=panel))
        return rewrite_kernels(mod, rewrites)


def _panel(weight: WeightParameter, target: Target) -> int | None:
    """The panel width for ``weight``, or None where it stays [K, N].

    Whole panels of MatmulEpilogue's column tile when they divide N, or when padding the last
    one adds at most 1/8 zero columns. A width over one vector that is not a multiple of it is
    padded to whole vectors whatever it costs: unpacked, its tile would be the width's largest
    divisor (one column for 59 tags: scalar code), while a zero-padded vector
    computes its padding in the instruction that computes the real columns. A width of whole
    vectors keeps its vector-wide tiles unpacked, and one under a vector stays too (a single
    panel's index folds away and the matmul is no longer one the rule matches).
    """
    lanes = vector_lanes(target, "float32")
    panel = MATMUL_TILE_VECTORS * lanes
    columns = weight.columns
    if weight.depth < 2:
        return None  # a unit K axis would be folded away
    if columns % panel == 0:
        return panel if columns > panel else None  # one panel is the matrix itself
    if columns > panel and -columns % panel <= columns * _MAX_PANEL_PADDING:
        return panel
    if columns % lanes == 0 or columns < lanes:
        return None
    # The wider panel only where it pads no more columns (59: 64 either way; 35: 48, not 64).
    return panel if columns > panel and -columns % panel <= -columns % lanes else lanes


def pack_columns(weight: np.ndarray, panel: int) -> np.ndarray:
    """[K, N] -> [ceil(N / panel), K, panel], the last panel padded with zero columns."""
    rows, cols = weight.shape
    panels = -(-cols // panel)
    padded = np.zeros((rows, panels * panel), weight.dtype)
    padded[:, :cols] = weight
    return np.ascontiguousarray(padded.reshape(rows, panels, panel).transpose(1, 0, 2))


def _packed_kernel(func: tirx.PrimFunc, param: int, panel: int) -> tirx.PrimFunc:
    """``func`` with its weight parameter in column panels and its matmul over whole panels."""
    sch = s_tir.Schedule(func)
    matmul = only_reduction(sch).block
    ndim = len(sch.get(matmul).iter_vars)
    if _writes_parameter(sch.get(matmul), func):
        sch.cache_write(matmul, 0, "global")  # the output keeps its layout; the panels are internal
    weight = func.params[param]
    read = next(i for i, region in enumerate(sch.get(matmul).reads) if region.source.same_as(weight))
    columns = int(sch.get(matmul).iter_vars[-2].dom.extent)
    if columns % panel == 0:  # iterate panels, then columns (padding makes transform_layout do it)
        sch.transform_block_layout(matmul, tirx.IndexMap.from_func(
            lambda *index: (*index[:-2], index[-2] // panel, index[-2] % panel, index[-1]), ndim=ndim))
    # The matmul's result in panels too: its block then iterates whole panels (the padding
    # columns included) and its consumers read only the real columns.
    sch.transform_layout(matmul, ("write", 0), lambda *index: (*index[:-1], index[-1] // panel, index[-1] % panel),
                         pad_value=0.0)
    sch.transform_layout(matmul, ("read", read), lambda k, j: (j // panel, k, j % panel), pad_value=0.0)
    return _drop_padding_guards(sch.mod["main"], sch.get(matmul).name_hint)


def _drop_padding_guards(func: tirx.PrimFunc, matmul: str) -> tirx.PrimFunc:
    """The padding ``transform_layout`` guards needs no guard: its weight columns are zeros
    (``pack_columns``), so the unguarded sum is the pad value 0. Drops the matmul's
    ``if_then_else(padding, 0, value)`` and the block that states the weight's padding."""

    def unguard(call):
        if call.op.same_as(tvm.ir.Op.get("prim.if_then_else")):
            return call.args[2]
        return call

    def in_matmul(block):
        if block.name_hint != matmul:
            return block
        return tvm_ffi.structural_map(block, [(Call, unguard)])

    body = tvm_ffi.structural_map(func.body, [(s_tir.SBlock, in_matmul)])
    return func.with_body(without_root_statements(body, _states_padding))


def _states_padding(stmt) -> bool:
    names = []
    tvm_ffi.structural_walk(stmt, (s_tir.SBlock, lambda block: names.append(block.name_hint)))
    return bool(names) and all(name.endswith(_PAD_CHECK_SUFFIX) for name in names)


def _writes_parameter(block: s_tir.SBlock, func: tirx.PrimFunc) -> bool:
    return any(block.writes[0].source.same_as(param) for param in func.params)


__all__ = ["PackMatmulWeights", "pack_columns"]
