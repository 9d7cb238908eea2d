"""Softmax over the last axis (with its element-wise prologue and epilogue) as one-pass warp
reductions: a warp per row, the logits read from global memory once into shared memory, the
row max and the sum of exponentials reduced with warp shuffles, each exponential computed once."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .rows import combiner, gpu_schedule, reductions, schedule_rows


class WarpSoftmax(ScheduleRule):
    """A kernel with exactly two reductions over the last axis, a max then a sum.

    dlight's ``GeneralReduction`` gives each row 256 threads and inlines the exponentials into
    the sum and the output, reading the logits three times and computing each exponential twice.
    """

    target_kinds = ("cuda",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = gpu_schedule(func, target)
        if sch is None:
            return None
        found = reductions(sch)
        if len(found) != 2 or [combiner(sch, b) for b in found] != [tirx.Max, tirx.Add]:
            return None
        try:
            layout = schedule_rows(sch)
        except s_tir.ScheduleError:
            return None  # blocks that do not follow the rows: not this rule's shape
        return sch if layout is not None else None
