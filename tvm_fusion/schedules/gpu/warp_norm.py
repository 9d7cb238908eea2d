"""LayerNorm, skip LayerNorm and RMSNorm (with their residual and bias adds) as one-pass warp
reductions: a warp per row, the row read from global memory once into shared memory, its
statistics reduced with warp shuffles, normalized and scaled in the same kernel."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .rows import block_names, gpu_schedule, schedule_rows

# The output blocks of TOPI's layer_norm and rms_norm, as LegalizeOps names them.
NORM_BLOCKS = ("T_layer_norm", "T_rms_norm")


class WarpNorm(ScheduleRule):
    """A kernel whose output is a layer_norm or rms_norm over the last axis, with any
    element-wise blocks before it (the residual sum, also as a second output).

    dlight's ``GeneralReduction`` gives each row 256 threads and inlines the residual sum into
    the mean, the variance and the output, so x, bias and skip are read three times; it
    declines the kernel whose sum is also an output, which then falls to ``Fallback`` (the
    statistics of every row summed serially by one thread).
    """

    target_kinds = ("cuda",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = gpu_schedule(func, target)
        if sch is None or not any(name in NORM_BLOCKS for name in block_names(sch)):
            return None
        try:
            layout = schedule_rows(sch)
        except s_tir.ScheduleError:
            return None  # blocks that do not follow the rows: not this rule's shape
        return sch if layout is not None else None
