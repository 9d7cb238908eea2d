"""NCHW conv2d_transpose + fused epilogue, without the multiplies by the dilation's zeros
where the kernel equals the stride.

TOPI lowers a transposed conv to ``data_dilate`` (insert ``stride - 1`` zeros between input
pixels) -> ``data_pad`` -> ``kernel_transform`` (IOHW -> flipped OIHW) -> a direct conv over
the dilated map, so ``stride**2 - 1`` of every ``stride**2`` multiplies are by zero. The conv
rule does not take it: its weight is read flipped and transposed.

Two schedules, both register-blocked like ``Conv2dNCHW`` (``oc_tile`` channels x a vector of
output columns, epilogue on the tile before it is stored, rows across cores):

* polyphase, when kernel == stride == 2 with no leading padding (the 2x2/stride-2 upsampling of
  DBNet, U-Net and FPN heads): output rows and columns are split by phase ``(h % s, w % s)``
  and the (phase, tap) loops are partitioned into unit loops, so each copy knows its phase
  at compile time and the simplifier deletes the copies that read a dilation zero. What is
  left reads the undilated input directly, one tap per phase: the multiplies of the dense
  transposed conv and no more. The accumulator tile is stored phase-major so each copy
  updates whole vectors.
* dilated, otherwise: the padded dilated map is materialized by a parallel pre-pass and
  convolved like a plain conv.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Op
from tvm.ir.expr import Call, TensorLoad
from tvm.sym.analyzer import Analyzer
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_static, only_reduction
from ...targets.target_info import vector_lanes
from .helpers import (TILE_SCOPE, cpu_schedule, extent, inline_cheap_blocks, iter_kinds, largest_divisor, row_tile,
                      schedule_pad, store_tile_epilogue, vectorized_init)
from .symbolic_width import schedule_by_width, static_except, width_tiles

_MAX_ACCUMULATORS = 16
# Partitioning makes (stride * kernel)**2 copies of the conv body; beyond stride 2 the code
# grows faster than the zeros it saves.
_POLYPHASE_STRIDE = 2
_IF_THEN_ELSE = Op.get("prim.if_then_else")


class Conv2dTranspose(ScheduleRule):
    """TOPI's conv2d_transpose_nchw (any stride, padding, output_padding, groups) + epilogue.

    Output rows and columns may be symbolic (a model compiled for a range of sizes): the
    column tiles are then full, the last one of a row shifted back, one copy of the kernel
    per tile width (``symbolic_width.py``).
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        prepared = None if sch is None else _prepare(sch)
        if prepared is None:
            return None
        sch = s_tir.Schedule(prepared)
        pad, conv, epilogue = _match(sch)
        lanes = vector_lanes(target, sch.get(conv).writes[0].source.dtype)
        polyphase = _polyphase_stride(sch, pad[0], conv) is not None
        width = sch.get(sch.get_loops(conv)[3]).extent
        if is_static(width):
            if polyphase:
                _schedule_polyphase(sch, pad[0], conv, epilogue, lanes)
            else:
                _schedule_dilated(sch, pad, conv, epilogue, lanes)
            return sch
        if polyphase:
            # Tiles of one phase's columns: the tiled loop runs over the input's width.
            columns = Analyzer().simplify(tirx.floordiv(width, _POLYPHASE_STRIDE))

            def schedule(copy, tile):
                copy_pad, copy_conv, copy_epilogue = _match(copy)
                return _schedule_polyphase(copy, copy_pad[0], copy_conv, copy_epilogue, lanes, tile)

            return schedule_by_width(prepared, columns, width_tiles(lanes, lanes), schedule)
        return schedule_by_width(prepared, width, width_tiles(2 * lanes, lanes),
                                 lambda copy, tile: _schedule_dilated(copy, *_match(copy), lanes, tile))


def _prepare(sch: s_tir.Schedule) -> tirx.PrimFunc | None:
    """The kernel with the dilation inlined into the pad (one select for both) and cheap
    blocks inlined; None when it is not a transposed conv this rule takes."""
    names = {sch.get(block).name_hint for block in sch.get_child_blocks(get_root_block(sch))}
    if not {"data_dilate", "data_pad", "kernel_transform"} <= names:
        return None
    sch.compute_inline(sch.get_sblock("data_dilate"))
    # One select for "inside the padding and not a dilation zero", so that a copy whose
    # phase makes the second part false folds to zero however the first part turns out.
    sch = s_tir.Schedule(_merge_nested_selects(sch.mod["main"]))
    inline_cheap_blocks(sch)
    kernel = only_reduction(sch)
    if kernel is None:
        return None
    stmt = kernel.stmt
    if iter_kinds(stmt) != "SSSSRRR" or len(kernel.prologue) != 1 or not static_except(stmt, (2, 3)):
        return None
    return sch.mod["main"]


def _match(sch: s_tir.Schedule) -> tuple[list, object, list]:
    """(pad blocks, the conv, its epilogue) of a ``_prepare``d kernel."""
    kernel = only_reduction(sch)
    return kernel.prologue, kernel.block, kernel.epilogue


def _merge_nested_selects(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``select(a, select(b, x, z), z)`` -> ``select(a && b, x, z)`` (the dilate inlined into
    the pad); the simplifier folds neither ``select(a, z, z)`` nor ``z * w`` across them."""

    def merge(call):
        if not call.op.same_as(_IF_THEN_ELSE):
            return call
        outer_cond, inner, otherwise = call.args
        if (isinstance(inner, Call) and inner.op.same_as(_IF_THEN_ELSE)
                and tvm_ffi.structural_equal(inner.args[2], otherwise)):
            return tirx.if_then_else(tirx.And(outer_cond, inner.args[0]), inner.args[1], otherwise)
        return call

    return tvm_ffi.structural_map(func, (Call, merge))


def _polyphase_stride(sch: s_tir.Schedule, pad, conv) -> int | None:
    """The stride when it equals the kernel (both dims) and there is no leading padding, so
    every output pixel reads exactly one in-bounds input pixel; None otherwise."""
    loads = []
    tvm_ffi.structural_walk(sch.get(pad).body, (TensorLoad, loads.append))
    if len(loads) != 1 or len(loads[0].indices) != 4:
        return None
    rows, cols = loads[0].source.shape[2:]
    _, _, y, x, _, ry, rx = sch.get_loops(conv)
    analyzer = Analyzer()
    for index, out_loop, tap_loop, size in ((loads[0].indices[2], y, ry, rows),
                                            (loads[0].indices[3], x, rx, cols)):
        # The dilated-and-padded map reads input[(i - (kernel - 1 - pad_begin)) // stride].
        dilation = _floordiv_offset(index)
        kernel = extent(sch, tap_loop)
        if (dilation != (_POLYPHASE_STRIDE, kernel - 1) or kernel != _POLYPHASE_STRIDE
                or not analyzer.can_prove_equal(sch.get(out_loop).extent, size * kernel)):
            return None
    return _POLYPHASE_STRIDE


def _floordiv_offset(index) -> tuple[int, int] | None:
    """``(s, c)`` for an index ``(v - c) // s``; None for any other form."""
    if not isinstance(index, tirx.FloorDiv) or not isinstance(index.b, tirx.IntImm):
        return None
    numerator = index.a
    if isinstance(numerator, tirx.Var):
        return int(index.b.value), 0
    if isinstance(numerator, tirx.Sub) and isinstance(numerator.b, tirx.IntImm):
        return int(index.b.value), int(numerator.b.value)
    if isinstance(numerator, tirx.Add) and isinstance(numerator.b, tirx.IntImm):
        return int(index.b.value), -int(numerator.b.value)
    return None


def _schedule_dilated(sch, pad, conv, epilogue, lanes, ow_tile: int | None = None):
    """Returns the column-tile loop; ``ow_tile`` is chosen from the width when it is static."""
    schedule_pad(sch, pad)
    n, f, y, x, rc, ry, rx = sch.get_loops(conv)
    ow_tile = ow_tile or row_tile(extent(sch, x), lanes, max_vectors=2)
    vectors = -(-ow_tile // lanes)
    oc_tile = largest_divisor(extent(sch, f), _MAX_ACCUMULATORS // vectors)
    f_outer, f_inner = sch.split(f, [None, oc_tile])
    x_outer, x_inner = sch.split(x, [None, ow_tile])
    sch.reorder(n, f_outer, y, x_outer, rc, ry, rx, f_inner, x_inner)
    store_tile_epilogue(sch, conv, epilogue, x_outer)
    sch.parallel(sch.fuse(n, f_outer, y))
    sch.unroll(f_inner)
    sch.vectorize(x_inner)
    vectorized_init(sch, conv, rc)
    return x_outer


def _schedule_polyphase(sch, pad, conv, epilogue, lanes, cols: int | None = None):
    """Returns the column-tile loop; ``cols`` (columns of one phase per tile) is chosen from
    the width when it is static."""
    stride = _POLYPHASE_STRIDE
    sch.compute_inline(pad)
    n, f, y, x, rc, ry, rx = sch.get_loops(conv)
    y_outer, y_phase = sch.split(y, [None, stride])
    x_outer, x_phase = sch.split(x, [None, stride])
    # Columns of one phase are contiguous in the input: a tile is a vector of them.
    cols = cols or row_tile(extent(sch, x_outer), lanes, max_vectors=1)
    oc_tile = largest_divisor(extent(sch, f), _MAX_ACCUMULATORS // stride**2)
    f_outer, f_inner = sch.split(f, [None, oc_tile])
    x_tile, x_inner = sch.split(x_outer, [None, cols])
    sch.reorder(n, f_outer, y_outer, x_tile, rc, y_phase, ry, rx, x_phase, f_inner, x_inner)
    # Phase-major accumulator: each (row phase, column phase) is a run of whole vectors.
    writeback = sch.cache_write(conv, 0, TILE_SCOPE)
    sch.transform_layout(conv, ("write", 0),
                         lambda b, c, h, w: (b, c, h % stride, w % stride, h // stride, w // stride))
    chain = [writeback, *epilogue]
    for block in chain[:-1]:
        sch.compute_inline(block)
    output = chain[-1]
    sch.reverse_compute_at(output, x_tile, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(output)[-1])
    sch.parallel(sch.fuse(n, f_outer, y_outer))
    sch.unroll(f_inner)
    sch.vectorize(x_inner)
    vectorized_init(sch, conv, rc)
    _partition_phases_and_taps(sch, conv)
    return x_tile


def _partition_phases_and_taps(sch, update) -> None:
    """Split the row phase, the two taps and the column phase (loops 3..6 under the parallel
    loop) into unit loops, so every copy of the body sees its phase and tap as constants."""
    name = sch.get(update).name_hint
    sch.loop_partition(sch.get_loops(update)[3], [1, None])
    for _ in range(3):
        for copy in _leaf_blocks(sch, name):
            # A partitioned copy sits in its own block: its first loop is the unit one.
            sch.loop_partition(sch.get_loops(copy)[1], [1, None])


def _leaf_blocks(sch, prefix: str) -> list:
    """The blocks named ``prefix...`` with no blocks inside (the partitioned copies)."""
    found = []

    def walk(block):
        for child in sch.get_child_blocks(block):
            if sch.get(child).name_hint.startswith(prefix) and not sch.get_child_blocks(child):
                found.append(child)
            walk(child)

    walk(get_root_block(sch))
    return found
