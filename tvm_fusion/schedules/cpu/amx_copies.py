"""A sum split by ``loop_partition`` into copies (row tiles of 16 and a tail: ``amx_tiles``)
made schedulable again, so that each copy can be tensorized."""

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.analysis import get_sblock_read_write_region
from tvm.sym import Analyzer

from ...kernels.blocks import is_static


def normalized_copies(func: tirx.PrimFunc, names: list[str]) -> tirx.PrimFunc:
    """``func`` after ``loop_partition`` made schedulable again for the copies ``names``: a
    partition that starts past 0 (rows 192..196) made to start at 0, its loop and its block's
    row axis, the offset moved into the block's body (blockize and tensorize take no other);
    and each copy's read and write regions detected again from its body (each declares the
    region of its whole partition, which tensorize would compare with the intrinsic's tile)."""
    buffers = {param: param for param in func.params}
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, lambda b: buffers.update({x: x for x in b.alloc_buffers}))])
    analyzer = Analyzer()

    def shifted(stmt, var, start):
        return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda v: v + start if v.same_as(var) else v)])

    def realize(node: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        block = node.block
        if block.name_hint not in names:
            return node
        iter_vars, values, body, init = [], [], block.body, block.init
        for iter_var, value in zip(block.iter_vars, node.iter_values):
            start = iter_var.dom.min
            if not (is_static(start) and int(start) == 0):
                zero = tirx.IntImm(start.ty.dtype, 0)
                iter_var = tirx.IterVar(tvm.ir.Range.from_min_extent(zero, iter_var.dom.extent), iter_var.var,
                                        iter_var.iter_type)
                body = shifted(body, iter_var.var, start)
                init = shifted(init, iter_var.var, start) if init is not None else None
                value = analyzer.simplify(value - start)
            iter_vars.append(iter_var)
            values.append(value)
        block = s_tir.SBlock(iter_vars, [], [], block.name_hint, body, init, block.alloc_buffers,
                             block.match_buffers, block.annotations)
        reads, writes = get_sblock_read_write_region(block, buffers)
        block = s_tir.SBlock(iter_vars, reads, writes, block.name_hint, body, init, block.alloc_buffers,
                             block.match_buffers, block.annotations)
        return s_tir.SBlockRealize(values, node.predicate, block)

    def from_zero(loop: tirx.For) -> tirx.For:
        if is_static(loop.min) and int(loop.min) == 0:
            return loop
        return tirx.For(loop.loop_var, tirx.IntImm(loop.min.ty.dtype, 0), loop.extent, loop.kind,
                        shifted(loop.body, loop.loop_var, loop.min), loop.thread_binding, loop.annotations)

    body = tvm_ffi.structural_map(func.body, [(tirx.For, from_zero)])
    return func.with_body(tvm_ffi.structural_map(body, [(s_tir.SBlockRealize, realize)]))
