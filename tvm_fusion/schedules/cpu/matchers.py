"""What the rules read of a direct conv's and a softmax's blocks, and what rules choose alike:
the matmul's register tile, the conv's tiles by output width. How a matmul kernel reads (its
axes, the kernels MatmulEpilogue schedules) is ``kernels/matmul.py``, shared with the weight
packing.

A helper module like ``helpers``: rules import from it, it defines no ScheduleRule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.sym import detect_linear_equation
from tvm.target import Target

from ...kernels.blocks import indices_are, is_spatial, is_static, only_reduction
from ...kernels.matmul import MATMUL_TILE_VECTORS
from ...targets.target_info import vector_lanes, vector_registers
from .helpers import (MIN_VECTOR_PIECE, cpu_schedule, extent_of, inline_cheap_blocks, iter_kinds, largest_divisor,
                      power_of_two_width, row_tile, same_extents)
from .symbolic_width import overlapped_tile, schedule_by_width, schedule_static_width, static_except, width_tiles

# -- Matmul ------------------------------------------------------------------------------------

# Rows of the register tile: 8 rows x 2 vectors of columns keeps 16 accumulators in
# AVX-512's 32 registers, with room for the B vectors and the broadcast A value.
MATMUL_TILE_ROWS = 8
MATMUL_K_UNROLL = 4


def matmul_tile_rows(target: Target) -> int:
    """Rows per register tile (of two vectors): 8 with 32 vector registers; 6 with 16 (AVX2),
    where 8 x 2 accumulators plus the B vectors and A broadcast spill."""
    return MATMUL_TILE_ROWS if vector_registers(target) >= 32 else (16 - 4) // MATMUL_TILE_VECTORS


def matmul_tile_columns(extent: int, lanes: int, target: Target) -> int:
    """Columns per tile: whole vectors when they divide the extent; else narrower power-of-two
    vectors, as many per row as the register file holds (120 columns on 16 lanes: 3 x 8); else
    the largest divisor."""
    for vectors in (MATMUL_TILE_VECTORS, 1):
        if extent % (vectors * lanes) == 0:
            return vectors * lanes
    width = power_of_two_width(extent, lanes)
    if width >= MIN_VECTOR_PIECE:
        return width * largest_divisor(extent // width, _narrow_vectors_per_row(target))
    return largest_divisor(extent, MATMUL_TILE_VECTORS * lanes)


def _narrow_vectors_per_row(target: Target) -> int:
    """Narrow vectors per tile row: the rows' accumulators, one B vector each and A's broadcast
    fill the register file (AVX-512: 8 rows x 3 + 3 + 1 = 28 of 32; AVX2: 6 x 2 + 2 + 1)."""
    rows = matmul_tile_rows(target)
    return max(1, (vector_registers(target) - 1) // (rows + 1))




# -- Direct conv -------------------------------------------------------------------------------


@dataclass
class ConvBlocks:
    """The blocks of a legalized conv kernel, in order: prologue pad, the conv, its epilogue."""

    pad: list
    conv: object
    epilogue: list
    depthwise: bool
    column_stride: int  # input elements between adjacent outputs along the tiled axis
    # One output column and static, unit-stride rows (a 1-D conv exported as an Nx1 Conv2d):
    # rows are then contiguous in memory like columns, and the rules tile them instead.
    tiles_rows: bool = False

    def tiled_loops(self, loops: list) -> list:
        """``loops`` (n, f, y, x, rc, ry, rx) with y and x swapped when the tiles run along the
        rows, so that a rule reads ``n, f, rows, columns, ...`` either way."""
        n, f, y, x, *reduction = loops
        return [n, f, x, y, *reduction] if self.tiles_rows else loops


def match_conv(sch: s_tir.Schedule) -> ConvBlocks | None:
    """Blocks of ``[pad] -> conv2d_nchw (SSSSRRR) -> elementwise..``, or None.

    Cheap spatial prologue blocks (an SE scale) are inlined into the pad/conv first. Output
    rows and columns may be symbolic; batch, channels and the kernel window must be static.
    """
    inline_cheap_blocks(sch)
    kernel = only_reduction(sch)
    if kernel is None:
        return None
    stmt = kernel.stmt
    if iter_kinds(stmt) != "SSSSRRR" or not static_except(stmt, (2, 3)):
        return None
    store = stmt.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    if not isinstance(store.value.b, tirx.Mul):
        return None
    n, f, y, x, rc, ry, rx = (iv.var for iv in stmt.iter_vars)
    if not all(a.same_as(b) for a, b in zip(store.indices, (n, f, y, x))):
        return None
    product = store.value.b
    weight_is_b = _loads_at(product.b, (f, rc, ry, rx))
    if not (weight_is_b or _loads_at(product.a, (f, rc, ry, rx))):
        return None
    # The data side may carry an inlined prologue (an SE scale): the feature map is its
    # largest 4-D input.
    data_side = product.a if weight_is_b else product.b
    maps = [ld for ld in _loads(data_side) if len(ld.indices) == 4 and is_static(ld.source.shape[1])]
    if not maps:
        return None
    feature_map = max(maps, key=lambda load: _size(load.source))
    channels_in = int(feature_map.source.shape[1])
    stride, _ = detect_linear_equation(feature_map.indices[3], [x]) or (1, None)
    row_stride, _ = detect_linear_equation(feature_map.indices[2], [y]) or (0, None)
    channels_out = int(stmt.iter_vars[1].dom.extent)
    depthwise = int(stmt.iter_vars[4].dom.extent) == 1 and channels_in == channels_out > 1
    height, width = (iv.dom.extent for iv in stmt.iter_vars[2:4])
    tiles_rows = (is_static(width) and int(width) == 1 and is_static(height) and int(height) > 1
                  and int(row_stride) == 1)
    return ConvBlocks(kernel.prologue, kernel.block, kernel.epilogue, depthwise,
                      1 if tiles_rows else int(stride), tiles_rows)


def conv_kernel(func, target: Target, depthwise: bool) -> tuple[s_tir.Schedule, ConvBlocks, int] | None:
    """For a CPU PrimFunc that is a conv (``match_conv``), depthwise or not as asked: a schedule
    of it, its blocks and the vector lanes of its dtype; None otherwise."""
    sch = cpu_schedule(func, target)
    blocks = None if sch is None else match_conv(sch)
    if blocks is None or blocks.depthwise != depthwise:
        return None
    return sch, blocks, vector_lanes(target, sch.get(blocks.conv).writes[0].source.dtype)


def schedule_conv_tiles(func: tirx.PrimFunc, sch: s_tir.Schedule, blocks: ConvBlocks, lanes: int,
                        max_vectors: int, schedule: Callable) -> s_tir.Schedule | None:
    """The conv scheduled by ``schedule(sch, blocks, ow_tile)``, which tiles the output columns
    and returns the column-tile loop: at a static width once, ``row_tile`` columns a tile, or
    whole vectors with the last tile shifted back when no whole vector divides the row (13,
    26, 52 columns); at a symbolic width once per tile width on copies of ``func``
    (``symbolic_width.py``)."""
    width = sch.get(blocks.tiled_loops(sch.get_loops(blocks.conv))[3]).extent
    if is_static(width):
        width = int(width)
        tile = row_tile(width, lanes, max_vectors)
        if tile % lanes and width > lanes:
            tile = overlapped_tile(width, [vectors * lanes for vectors in range(max_vectors, 0, -1)])
        return schedule_static_width(sch, width, tile, lambda copy, tile: schedule(copy, blocks, tile))
    return schedule_by_width(func, width, width_tiles(max_vectors * lanes, lanes),
                             lambda copy, tile: schedule(copy, match_conv(copy), tile))


def splits_column_phases(sch: s_tir.Schedule, blocks: ConvBlocks) -> bool:
    """True for a stride-2 conv over a padded map of static width: ``split_column_phases``
    applies."""
    return (blocks.column_stride == 2 and bool(blocks.pad) and not blocks.tiles_rows
            and is_static(sch.get(blocks.pad[-1]).writes[0].source.shape[-1]))


def split_column_phases(sch: s_tir.Schedule, blocks: ConvBlocks) -> None:
    """For a stride-2 conv over a padded map (``splits_column_phases``): store the padded map
    as each row's even columns, then its odd ones, so that every window tap reads one
    contiguous vector instead of gathering every other column."""
    if splits_column_phases(sch, blocks):
        sch.transform_layout(blocks.pad[-1], ("write", 0),
                             lambda *index: (*index[:-1], index[-1] % 2, index[-1] // 2), pad_value=0.0)


def _loads_at(expr, variables) -> bool:
    return isinstance(expr, TensorLoad) and indices_are(expr.indices, variables)


def _loads(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, (TensorLoad, found.append))
    return found


def _size(buffer) -> int:
    """Elements of ``buffer``, a symbolic dim counting as larger than any static one (the
    feature map of a model compiled for a range of sizes, next to a static gate)."""
    size = 1
    for dim in buffer.shape:
        size *= int(dim) if is_static(dim) else 1 << 40
    return size


# -- Softmax -----------------------------------------------------------------------------------


def is_softmax(sch: s_tir.Schedule) -> bool:
    """Exactly two reductions, a max then a sum, over the same domain, each reducing its last
    iteration axis (which axis of the input that reads is up to the rule: ``Softmax`` takes
    the innermost, ``SoftmaxOverOuterAxis`` the others)."""
    stmts = [sch.get(block) for block in sch.get_child_blocks(get_root_block(sch))]
    reductions = [stmt for stmt in stmts if not is_spatial(stmt)]
    if len(reductions) != 2:
        return False
    combiners = [type(getattr(stmt.body, "value", None)) for stmt in reductions]
    if combiners != [tirx.Max, tirx.Add]:
        return False
    domains = []
    for stmt in reductions:
        kinds = [iv.iter_type for iv in stmt.iter_vars]
        if kinds[-1] != tirx.IterVar.CommReduce or tirx.IterVar.CommReduce in kinds[:-1]:
            return False
        domains.append([extent_of(iv.dom.extent) for iv in stmt.iter_vars])
    return same_extents(*domains)
