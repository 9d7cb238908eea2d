"""A whole tensor reduced to one value or a few (a DynamicQuantizeLinear's min and max, a global
sum): the flattened reduction split across vector registers, and across cores past a size.

``Reduction`` parallelizes over output rows and leaves the reduction itself a scalar loop: with
one output that is one core running one dependent chain of min/max/add operations. Here the
flattened reduction is split into ``[task, step, lane]``, and two ``rfactor`` steps give each
task (a core; one task below ``MIN_PARALLEL_ELEMENTS``) ``ACCUMULATOR_VECTORS`` vector
registers of partial results, updated from contiguous loads; each task then combines its lanes,
and the tasks' few partials are combined last. Whatever the block combines with (min, max, sum,
product...) ``rfactor`` reads from its init and update, and refuses a combiner it does not know.

A float sum comes out in another order than the serial loop's (not bit-identical); a min or a
max is exact in any order.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import among, indices_are, is_static, only_reduction
from ...targets.target_info import num_cores, vector_lanes
from .helpers import cpu_schedule, extent_of, iter_kinds
from .small_extent import serial_when_small

# More outputs than this fill the cores as rows of their own: the kernel is Reduction's.
MAX_OUTPUTS = 8
# Independent vector registers each task updates: a vector min or add waits on the previous one
# to the same register, so one register would run at that latency, not at the loads' speed.
ACCUMULATOR_VECTORS = 4
# Elements (16 MB of float32) below which one core reduces the tensor alone. One core's vector
# loads already stream from its L2, or from memory on a machine of few cores, as fast as the
# cores together (measured on two); splitting then costs a thread wake-up and moves the lines to
# the other core. Past any core's L2, a core alone is limited by the misses it can have in flight.
MIN_PARALLEL_ELEMENTS = 1 << 22


class WholeTensorReduction(ScheduleRule):
    """One reduction block over all its input's trailing axes into at most ``MAX_OUTPUTS``
    values, with only element-wise blocks before it (inlined: each element is read once).

    Declines (None): more outputs (rows for ``Reduction``), several reductions (a softmax, a
    norm), a reduction shorter than two vectors (the serial loop is as fast), an input read not
    contiguous along the innermost reduction axis (a column sum, a matmul's weight), several
    outputs written by the block (argmax), or a combiner ``rfactor`` does not take.
    """

    # Pooling would take a whole tensor kept as [1, 1, 1] (keepdims) as a global pool, with one
    # vector of partials.
    runs_before = ("Pooling", "Reduction")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target, inline_cheap=True)
        block = None if sch is None else _lone_reduction(sch)
        if block is None:
            return None
        stmt = sch.get(block)
        spatial = iter_kinds(stmt).count("S")
        extents = [extent_of(iv.dom.extent) for iv in stmt.iter_vars]
        length = math.prod(extents[spatial:])  # a PrimExpr where an extent is symbolic
        outputs = math.prod(extents[:spatial])  # static: _lone_reduction checked
        lanes = vector_lanes(target, str(stmt.writes[0].source.dtype))
        if isinstance(length, int) and length < 2 * lanes:
            return None
        width = _vector_group(_static_factor(extents[spatial:]), lanes)
        tasks = num_cores(target) if not isinstance(length, int) or outputs * length >= MIN_PARALLEL_ELEMENTS else 1
        if isinstance(length, int):
            tasks = min(tasks, -(-length // width))
        try:
            _split_across(sch, block, spatial, len(stmt.writes[0].source.shape), width, tasks)
        except s_tir.ScheduleError:
            return None  # a combiner rfactor cannot split
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS, static_tasks=True)


def _lone_reduction(sch: s_tir.Schedule):
    """The kernel's one reduction block, its element-wise producers inlined into it, when it is
    shaped for this rule (see ``WholeTensorReduction``); else None."""
    kernel = only_reduction(sch)
    if kernel is None or kernel.epilogue:
        return None  # several reductions, or work after it (FuseOps puts none there)
    block = kernel.block
    for producer in reversed(kernel.prologue):
        try:
            sch.compute_inline(producer)
        except s_tir.ScheduleError:
            return None  # also an output of the kernel, or read at other points than its own
    stmt = sch.get(block)
    kinds = iter_kinds(stmt)
    spatial = kinds.count("S")
    outputs = [iv.dom.extent for iv in stmt.iter_vars[:spatial]]
    if (len(stmt.writes) != 1 or kinds != "S" * spatial + "R" * (len(kinds) - spatial)
            or not all(is_static(e) for e in outputs) or math.prod(int(e) for e in outputs) > MAX_OUTPUTS):
        return None
    loops = sch.get_loops(block)
    if not indices_are(get_sblockrealize(sch, block).iter_values, [sch.get(loop).loop_var for loop in loops]):
        return None  # loops not one per axis in the block's order: the split below assumes them
    return block if _contiguous_reads(stmt, stmt.iter_vars[spatial:]) else None


def _contiguous_reads(block: s_tir.SBlock, reduction: list) -> bool:
    """True if every load that moves with the reduction has the innermost reduction axis as its
    last index (a load that does not, a broadcast scale, is the same for all lanes): the lanes
    of a vector are then consecutive elements."""
    innermost = reduction[-1].var
    variables = [iv.var for iv in reduction]
    loads = []
    tvm_ffi.structural_walk(block.body, (TensorLoad, loads.append))
    return all(not _uses(load.indices, variables) or load.indices[-1].same_as(innermost) for load in loads)


def _uses(exprs, variables: list) -> bool:
    used = []
    for expr in exprs:
        tvm_ffi.structural_walk(expr, (tirx.Var, lambda var: used.append(var) if among(var, variables) else None))
    return bool(used)


def _static_factor(extents: list) -> int:
    """The product of the constant extents: what the flattened length is surely a multiple of."""
    return math.prod(e for e in extents if isinstance(e, int))


def _vector_group(factor: int, lanes: int) -> int:
    """Elements one step of a task reduces: the largest divisor of ``factor`` between one
    vector and ``ACCUMULATOR_VECTORS`` of them (no remainder to predicate); a length none
    divides (a prime) takes the full width, its last step predicated."""
    widest = ACCUMULATOR_VECTORS * lanes
    return next((width for width in range(widest, lanes - 1, -1) if factor % width == 0), widest)


def _split_across(sch: s_tir.Schedule, block, spatial: int, output_ndim: int, width: int, tasks: int) -> None:
    """``block``'s reduction as ``tasks`` x ``width`` partial results: per task (across cores,
    with the output axes) a vector loop of ``width`` lanes over its contiguous share, then its
    lanes combined in the task, then the tasks' partials by the block itself."""
    loops = sch.get_loops(block)
    reduction = loops[spatial:]
    fused = sch.fuse(*reduction) if len(reduction) > 1 else reduction[0]
    # Lanes split first, so that a length the tasks do not divide leaves a predicate on the
    # steps only: TVM runs a vector loop with a predicate per lane as scalars (as it does for a
    # length ``width`` does not divide, a prime: correct, only slower).
    chunk, _ = sch.split(fused, [None, width])
    per_task = block
    if tasks > 1:
        task, _ = sch.split(chunk, [tasks, None])
        per_task = sch.rfactor(task, output_ndim)
    *outer, step, lane = sch.get_loops(per_task)
    per_lane = sch.rfactor(lane, output_ndim + (tasks > 1))
    *outer, step, lane = sch.get_loops(per_lane)
    sch.vectorize(lane)
    if tasks > 1:  # (before the init is split out: parallel wants a reduction block with its init)
        across = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        sch.parallel(across)
        sch.reverse_compute_at(per_task, across)
    init = sch.decompose_reduction(per_lane, step)
    sch.vectorize(sch.get_loops(init)[-1])
