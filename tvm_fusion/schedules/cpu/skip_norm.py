"""Skip LayerNorm / RMSNorm: the residual sum, its row statistics and the normalized row in one task."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...targets.target_info import vector_lanes
from .helpers import cpu_schedule, has_call, row_blocks
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small
from .vector_sum import NORM_BLOCKS, schedule_rows


class SkipNorm(ScheduleRule):
    """An element-wise sum (x + bias + skip) read by row reductions, then the normalized row.

    ``Reduction`` would inline the sum into the mean, the variance and the output, adding
    x, bias and skip three times per element, and cannot place the sum at all when it is
    also an output (``compute_at`` refuses output blocks). Here each task (one row, rows in
    parallel) writes the sum once into a row buffer (or into the sum output), reduces it with
    vector-wide partial sums, and normalizes it while it is still in L1.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        summed = None if sch is None else _residual_sum(sch)
        if summed is None:
            return None
        for block in sch.get_child_blocks(get_root_block(sch)):
            stmt = sch.get(block)
            if stmt.same_as(sch.get(summed)) or not is_spatial(stmt) or has_call(stmt.body):
                continue
            try:
                sch.compute_inline(block)  # the bias add into the sum, the mean into its users
            except s_tir.ScheduleError:
                continue
        rows = row_blocks(sch)
        if rows is None or len(rows[0]) < 3:
            return None
        blocks, row_axes = rows
        lanes = vector_lanes(target, sch.get(blocks[-1].block_rv).writes[0].source.dtype)
        try:
            sch = schedule_rows(sch, [b.block_rv for b in blocks], row_axes, lanes)
        except s_tir.ScheduleError:
            return None  # a shape this rule did not foresee: leave it to the next rule
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)  # a few symbolic rows: one core


def _residual_sum(sch: s_tir.Schedule):
    """The residual sum: the last element-wise add before the first reduction of a norm kernel."""
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    if not any(sch.get(b).name_hint in NORM_BLOCKS for b in blocks):
        return None
    first_reduction = next((i for i, b in enumerate(blocks) if not is_spatial(sch.get(b))), None)
    adds = [b for b in blocks[:first_reduction]
            if isinstance(sch.get(b).body, tirx.BufferStore) and isinstance(sch.get(b).body.value, tirx.Add)]
    return adds[-1] if first_reduction is not None and adds else None
