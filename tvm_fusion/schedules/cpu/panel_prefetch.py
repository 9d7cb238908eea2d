"""Software prefetch of a packed weight's next column panel, spread over the current panel's tasks.

A matmul with its weight in column panels (``passes/pack_matmul_weights.py``) runs panel by
panel: every row tile of a panel is a task that reads the whole panel, from L2 once the first
task has brought it in. But between one call and the next the weights leave L2 (a transformer
layer's are several times its size), so the first task of every panel waited on the panel's
lines coming from L3 or memory, the hardware prefetcher only a few lines ahead of the loads.
Here each task of panel p first asks for its share of panel p + 1 (one row tile's fraction),
into L2, so the panel's reads overlap the FMAs of the panel before it. The prefetches are one
burst before the task's K loop: one per K step inside that loop made the kernels slower, not
faster (a call in the register-tiled loop).
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from ...kernels.blocks import is_static
from ...kernels.matmul import panel_weight

CACHE_LINE_BYTES = 64
MIN_ROW_TILES = 4  # fewer row tiles a panel: a weight line feeds few FMAs, memory-bound anyway
MAX_LINES_PER_TASK = 256  # a longer burst would hold the fill buffers the task's own loads need
_L2_LOCALITY = 2  # llvm.prefetch's locality 2: into L2 (prefetcht1 on x86)


def prefetch_next_panel(sch: s_tir.Schedule, matmul, tile, k_outer, row_tiles) -> s_tir.Schedule:
    """``sch`` with the prefetches before ``k_outer`` in each task of the fused ``tile`` loop
    (batch.., panel, row tile; ``row_tiles`` of them a panel); ``sch`` itself where the weight is
    not in panels or the extents are not static."""
    weight = panel_weight(sch.get(matmul))
    if weight is None or not isinstance(row_tiles, int) or row_tiles < MIN_ROW_TILES:
        return sch
    if not all(is_static(d) for d in weight.shape):
        return sch
    panels, depth, columns = (int(d) for d in weight.shape)
    per_line = CACHE_LINE_BYTES * 8 // weight.dtype.bits
    lines = -(-depth * columns // per_line)
    per_task = min(-(-lines // row_tiles), MAX_LINES_PER_TASK)
    task, k_var = sch.get(tile).loop_var, sch.get(k_outer).loop_var
    index = task.ty.dtype
    line = tirx.Var("line", index)
    panel = tirx.min(tirx.floormod(tirx.floordiv(task, row_tiles), panels) + 1, panels - 1)
    element = tirx.min(tirx.floormod(task, row_tiles) * per_task + line, lines - 1) * per_line
    address = tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(
        weight, [panel, tirx.floordiv(element, columns), tirx.floormod(element, columns)]))
    prefetch = tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, tirx.const(0, "int32"),
                                                   tirx.const(_L2_LOCALITY, "int32"), tirx.const(1, "int32")))
    burst = tirx.For(line, tirx.const(0, index), tirx.const(per_task, index), tirx.ForKind.SERIAL, prefetch)

    def before_k_loop(loop: tirx.For):
        return tirx.SeqStmt([burst, loop]) if loop.loop_var.same_as(k_var) else loop

    func = sch.mod["main"]
    return s_tir.Schedule(func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, before_k_loop)])))
