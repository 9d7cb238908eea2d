"""A conv's AMX tiles loaded straight from its converted input: no patch matrix.

A patch kernel (``frontend/conv_patches.py``) copies every input value KH x KW times into patch
rows, stores them and reloads them as A tiles: on a 3x3 conv most of the kernel's time (the
copies, then the tile loads waiting on those stores). Where the input is converted pixel major
(``[N, H', W', C]``, its padding written) and C is whole A-tile rows of k
(``conv_geometry.reads_input_directly``), the k of one tile row lie within one tap's channels,
at one address per pixel (for a narrow input, within one kernel row's run of taps, padded to
whole tile rows: ``conv_geometry.reads_runs``), and a tile's rows (consecutive pixels of one output row) are a
column stride of C values apart. So each ``tileloadd`` of a patch tile can read the converted
input itself, with that stride: ``read_tiles_from_input`` points the loads there and drops the
patch block, after the schedule is done (the tensor intrinsics match a ``[rows, K]`` operand).
"""

from __future__ import annotations

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.ir.expr import Call, TensorLoad

from ...frontend.conv_patches import DIRECT_INPUT, PatchOperand

_ADDRESS_OF = ir.Op.get("tirx.address_of")


def read_tiles_from_input(sch: s_tir.Schedule, operand: PatchOperand) -> s_tir.Schedule:
    """``sch`` with the tile loads of a ``DIRECT_INPUT`` patch block's rows reading the converted
    input and the patch block gone; ``sch`` itself where the patches are read otherwise (register
    tiles) or there is no such block."""
    try:
        patch_block = sch.get(sch.get_sblock(operand.patches_name))
        converted = sch.get(sch.get_sblock(operand.input_name)).writes[0].source
    except s_tir.ScheduleError:
        return sch
    geometry = patch_block.annotations.get(DIRECT_INPUT)
    if geometry is None:
        return sch
    patches = patch_block.writes[0].source
    out_height, row_stride, column_stride, row_dilation, column_dilation, run, channels = (int(v) for v in geometry)
    stride = tirx.const(column_stride * channels * converted.dtype.bits // 8, "int64")
    left_over = []  # reads of a patch tile other than a tile load's address

    def input_element(line, column, k):
        """The converted input's element at patch row (line, column), k (over kh, kw, channel)."""
        kh, at = tirx.floordiv(k, run), tirx.floormod(k, run)
        kw, channel = tirx.floordiv(at, channels), tirx.floormod(at, channels)
        y = tirx.floormod(line, out_height) * row_stride + kh * row_dilation
        x = column * column_stride + kw * column_dilation
        return tirx.BufferLoad(converted, [tirx.floordiv(line, out_height), y, x, channel])

    def block(stmt: s_tir.SBlock) -> s_tir.SBlock:
        if stmt.name_hint == patch_block.name_hint:
            return stmt
        matched = [m for m in stmt.match_buffers if m.source.source.same_as(patches)]
        if not matched:
            return stmt
        (match,) = matched
        line, first_column, _ = (r.min for r in match.source.region)
        tile = match.buffer

        def load(call: Call) -> Call:
            address = call.args[2] if len(call.args) == 4 else None
            if not (isinstance(address, Call) and address.op.same_as(_ADDRESS_OF)
                    and isinstance(address.args[0], TensorLoad) and address.args[0].source.same_as(tile)):
                return call
            row, k = address.args[0].indices
            moved = tirx.call_intrin("handle", "tirx.address_of", input_element(line, first_column + row, k))
            return tirx.call_llvm_intrin("void", call.args[0], call.args[1], moved, stride)

        def stray(node: TensorLoad) -> None:
            if node.source.same_as(tile):
                left_over.append(node)

        body = tvm_ffi.structural_map(stmt.body, [(Call, load)])
        tvm_ffi.structural_walk(body, (TensorLoad, stray))  # any left: not only tile loads read it
        reads = [region if not region.source.same_as(patches) else tirx.BufferRegion(
            converted, [ir.Range.from_min_extent(0, extent) for extent in converted.shape]) for region in stmt.reads]
        return s_tir.SBlock(stmt.iter_vars, reads, stmt.writes, stmt.name_hint, body, stmt.init,
                            stmt.alloc_buffers, [m for m in stmt.match_buffers if not m.same_as(match)], stmt.annotations)

    def realize(stmt: s_tir.SBlockRealize):
        return tirx.Evaluate(0) if stmt.block.name_hint == patch_block.name_hint else stmt

    def unallocated(stmt: s_tir.SBlock) -> s_tir.SBlock:
        if not any(b.same_as(patches) for b in stmt.alloc_buffers):
            return stmt
        return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, stmt.body, stmt.init,
                            [b for b in stmt.alloc_buffers if not b.same_as(patches)], stmt.match_buffers,
                            stmt.annotations)

    func = sch.mod["main"]
    body = tvm_ffi.structural_map(func.body, [(s_tir.SBlock, block)])
    if left_over or body.same_as(func.body):
        return sch
    body = tvm_ffi.structural_map(body, [(s_tir.SBlockRealize, realize), (s_tir.SBlock, unallocated)])
    return s_tir.Schedule(func.with_body(body))

