"""Row reductions (softmax, layer norm, RMS norm) computed one row at a time, rows across cores."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...targets.target_info import vector_lanes
from .helpers import cpu_schedule, parallel_rows, row_blocks, vectorize_innermost
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small


class Reduction(ScheduleRule):
    """Blocks that all share leading row axes and reduce only over trailing axes.

    Every block is computed under the output's row loop, so the row's intermediates
    (max, exp, sum, mean) stay in cache; the row loop runs in parallel (a single row: one
    serial task, ``helpers.row_blocks`` gives its element-wise blocks their unit row), the inner
    element-wise loops run on vectors, and sums are split into vector-wide partial sums.
    """

    runs_after = ("*",)
    runs_before = ("Injective",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target, inline_cheap=True)
        rows = None if sch is None else row_blocks(sch)
        if rows is None or all(block.is_injective() for block in rows[0]):
            return None  # not row-shaped, the blocks disagree on the rows, or nothing reduces
        blocks, row_axes = rows
        dtype = sch.get(blocks[-1].block_rv).writes[0].source.dtype
        lanes = vector_lanes(target, dtype)

        output = blocks[-1].block_rv
        row = sch.fuse(*sch.get_loops(output)[:row_axes])
        parallel_rows(sch, row)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block.block_rv, row, preserve_unit_loops=True)
        for block in blocks:
            vectorize_innermost(sch, block.block_rv, row, lanes)
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)  # a few symbolic rows: one core

