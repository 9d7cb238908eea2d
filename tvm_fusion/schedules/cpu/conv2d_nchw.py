"""Register-blocked direct NCHW convolution with its epilogue computed inside each output tile.

The accumulator tile is ``oc_tile`` output channels x ``ow_tile`` output columns: for every
(input channel, kh, kw) one vector of input columns is loaded and multiplied by ``oc_tile``
broadcast weights, so each load feeds ``oc_tile`` FMAs (the same reuse NCHWc kernels get from
their channel block, without layout transforms around every conv). Bias, activations, the
residual add and an SE input scale run on the tile before it is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.sym import detect_linear_equation
from tvm.target import Target

from .inline import inline_cheap_blocks, is_spatial, iter_kinds, only_reduction
from .symbolic_width import is_static, schedule_by_width, static_except, width_tiles
from .target_info import vector_lanes

# 16 accumulator vectors + input vector + broadcasts fit AVX-512's 32 registers (and AVX2's 16
# at half the tile); at two vectors of columns per tile, half as many channels.
_MAX_ACCUMULATORS = 16


@dataclass
class ConvBlocks:
    """The blocks of a legalized conv kernel, in order: prologue pad, the conv, its epilogue."""

    pad: list
    conv: object
    epilogue: list
    depthwise: bool
    column_stride: int  # input columns between adjacent output columns


def match_conv(sch: s_tir.Schedule) -> ConvBlocks | None:
    """Blocks of ``[pad] -> conv2d_nchw (SSSSRRR) -> elementwise..``, or None.

    Cheap spatial prologue blocks (an SE scale) are inlined into the pad/conv first. Output
    rows and columns may be symbolic; batch, channels and the kernel window must be static.
    """
    inline_cheap_blocks(sch)
    found = only_reduction(sch)
    if found is None:
        return None
    blocks, index = found
    conv = blocks[index]
    stmt = sch.get(conv)
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
    weight_is_b = _reads_at(product.b, (f, rc, ry, rx))
    if not (weight_is_b or _reads_at(product.a, (f, rc, ry, rx))):
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
    channels_out = int(stmt.iter_vars[1].dom.extent)
    depthwise = int(stmt.iter_vars[4].dom.extent) == 1 and channels_in == channels_out > 1
    pad = [b for b in blocks[:index] if is_spatial(sch.get(b))]
    if len(pad) != index or any(not is_spatial(sch.get(b)) for b in blocks[index + 1:]):
        return None
    return ConvBlocks(pad, conv, list(blocks[index + 1:]), depthwise, int(stride))


def _reads_at(expr, variables) -> bool:
    return isinstance(expr, TensorLoad) and len(expr.indices) == len(variables) and all(
        index.same_as(var) for index, var in zip(expr.indices, variables))


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


def largest_divisor(extent: int, limit: int) -> int:
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def row_tile(width: int, lanes: int, max_vectors: int) -> int:
    """Columns per tile: whole vectors when they divide the row, else the largest divisor."""
    for vectors in range(max_vectors, 0, -1):
        if width % (vectors * lanes) == 0:
            return vectors * lanes
    return largest_divisor(width, lanes)


def extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def schedule_pad(sch: s_tir.Schedule, pad_blocks: list) -> None:
    """Padding copies run as their own pass: rows across cores (a select per element is not
    worth vectorizing, and padding inside the conv would put that select in the FMA loop).

    With a symbolic image size only the loops down to the row are fused: recovering a column
    from a fused index divides by the symbolic row length, a real division per pixel that cost
    more than the copy (2-3x a blocked conv's time at 224x224)."""
    for block in pad_blocks:
        loops = sch.get_loops(block)
        symbolic = [i for i, loop in enumerate(loops) if not is_static(sch.get(loop).extent)]
        rows = symbolic[-1] if len(symbolic) >= 2 else len(loops) - 1
        sch.parallel(sch.fuse(*loops[:rows]) if rows > 1 else loops[0])


def store_tile_epilogue(sch: s_tir.Schedule, conv, epilogue: list, at_loop) -> object:
    """Accumulate in a local tile and compute the epilogue from it at ``at_loop``; returns the
    block that stores the tile."""
    writeback = sch.cache_write(conv, 0, "local")
    chain = [writeback, *epilogue]
    for block in chain[:-1]:
        sch.compute_inline(block)
    output = chain[-1]
    sch.reverse_compute_at(output, at_loop, preserve_unit_loops=True)
    innermost = sch.get_loops(output)[-1]
    if extent(sch, innermost) > 1:
        sch.vectorize(innermost)
    return output


class Conv2dNCHW(ScheduleRule):
    """Dense and grouped NCHW conv2d (any stride, padding, dilation) + fused epilogue."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        blocks = match_conv(sch)
        if blocks is None or blocks.depthwise:
            return None
        dtype = sch.get(blocks.conv).writes[0].source.dtype
        lanes = vector_lanes(target, dtype)
        # A strided conv gathers its input vectors: one vector of columns and twice the
        # channels gets each gathered vector twice the FMAs (measured 1.2-1.4x on 3x3/2 convs
        # with 160-320 output columns).
        max_vectors = 2 if blocks.column_stride == 1 else 1
        width = sch.get(sch.get_loops(blocks.conv)[3]).extent
        if is_static(width):
            self._schedule(sch, blocks, row_tile(int(width), lanes, max_vectors), lanes)
            return sch
        return schedule_by_width(func, width, width_tiles(max_vectors * lanes, lanes),
                                 lambda copy, tile: self._schedule(copy, match_conv(copy), tile, lanes))

    @staticmethod
    def _schedule(sch: s_tir.Schedule, blocks: ConvBlocks, ow_tile: int, lanes: int):
        """Tiles of ``oc_tile`` channels x ``ow_tile`` columns; returns the column-tile loop."""
        schedule_pad(sch, blocks.pad)
        n, f, y, x, rc, ry, rx = sch.get_loops(blocks.conv)
        vectors = -(-ow_tile // lanes)
        oc_tile = largest_divisor(extent(sch, f), _MAX_ACCUMULATORS // vectors)
        f_outer, f_inner = sch.split(f, [None, oc_tile])
        x_outer, x_inner = sch.split(x, [None, ow_tile])
        sch.reorder(n, f_outer, y, x_outer, rc, ry, rx, f_inner, x_inner)
        store_tile_epilogue(sch, blocks.conv, blocks.epilogue, x_outer)
        sch.parallel(sch.fuse(n, f_outer, y))
        sch.unroll(f_inner)
        sch.vectorize(x_inner)
        init = sch.decompose_reduction(blocks.conv, rc)
        sch.vectorize(sch.get_loops(init)[-1])
        return x_outer
