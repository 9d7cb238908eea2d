"""A one-output-channel conv over a long strided row of taps (a FIR filter that decimates: the
CQT front end of an audio model, 1 -> 1 channel, 256 taps, stride 2): each output a dot product
of contiguous taps, summed in vector lanes.

``Conv2dNCHW`` puts output columns in vector lanes: with one output channel each input load
feeds a single FMA, and at stride 2 the loads are gathers. Here the taps go in the lanes
instead: for each output, contiguous loads of the input row and of the filter, ``taps / lanes``
vector FMAs into one register of partial sums, and a horizontal sum; outputs are shared among
the cores in runs of ``_OUTPUTS_PER_TASK``.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_static
from .matchers import conv_kernel

# A filter's taps that make the lanes worth their horizontal sum: four vectors.
_MIN_VECTORS_OF_TAPS = 4
_OUTPUTS_PER_TASK = 32


class ConvTapsInLanes(ScheduleRule):
    """Dense NCHW conv2d of one output channel, static shapes, a stride over its columns and a
    row of taps of at least four whole vectors (its epilogue per output). Declines otherwise."""

    runs_before = ("Conv2dNCHW",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        found = conv_kernel(func, target, depthwise=False)
        if found is None:
            return None
        sch, blocks, lanes = found
        extents = [iv.dom.extent for iv in sch.get(blocks.conv).iter_vars]  # n, f, y, x, rc, ry, rx
        if not all(is_static(e) for e in extents) or blocks.tiles_rows:
            return None
        out_channels, taps = int(extents[1]), int(extents[-1])
        if out_channels != 1 or blocks.column_stride < 2 or taps % lanes or taps < _MIN_VECTORS_OF_TAPS * lanes:
            return None
        for pad in blocks.pad:
            sch.compute_inline(pad)
        *_, tap_loop = sch.get_loops(blocks.conv)
        _, lane = sch.split(tap_loop, [None, lanes])
        partial = sch.rfactor(lane, factor_axis=4)  # the lanes' partial sums, per output
        output = sch.fuse(*sch.get_loops(blocks.conv)[:4])
        sch.compute_at(partial, output)
        for block in blocks.epilogue:
            sch.reverse_compute_at(block, output)
        task, _ = sch.split(output, [None, _OUTPUTS_PER_TASK])
        sch.parallel(task)
        lane, *reduction = sch.get_loops(partial)[2:]  # unit loops dropped: the lanes, the taps' vectors
        sch.reorder(*reduction, lane)
        sch.vectorize(lane)
        sch.decompose_reduction(partial, reduction[0])
        return sch
