"""Softmax (with its element-wise prologue and epilogue) one row at a time, reductions on vectors.

A row's max and sum are a chain of dependent scalar max/add operations when left as written
(the generic ``Reduction`` rule does that): latency-bound, ~4 cycles per element. Split the
key axis into [n / lanes, lanes] and ``rfactor`` the lanes: each reduction becomes a vector
max/add over n / lanes vectors plus one final ``lanes``-wide reduction. Everything else of
the row (scale, masks, exp, normalization, epilogue) is computed under the same parallel row
loop, so the row stays in L1 and the function reads its inputs and writes its output once.

A row that whole vectors do not divide (a CTC head over 6625 or 18385 classes) is reduced over
its padding to whole vectors where fast math's legalization wrote the softmax
(``kernels/padded_softmax.py``): a split that does not divide leaves a predicate that rfactor
drops, and a row left whole is one vector operation of thousands of lanes, which LLVM expands
into straight-line code. Its element-wise blocks run on whole vectors and one short vector for
the rest. Another softmax over such a row (fast math off) is split by a divisor between half and
twice a vector where there is one (25 lanes for 6625: PP-OCRv4's head, 40 x 6625, 500 -> 120 us).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...kernels.padded_softmax import padded_width
from ...targets.target_info import vector_lanes
from .helpers import (cpu_schedule, extent, extent_of, inline_cheap_blocks, parallel_rows, power_of_two_width,
                      same_extents, vectorized_init)
from .matchers import is_softmax
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small

# A partial-reduction vector narrower than this does not pay for its final reduction.
_MIN_REDUCTION_LANES = 4
# A row of up to this many vector registers that whole vectors do not divide (40 floats) is
# one vector operation; a longer one is split (see the module docstring).
_MAX_ROW_VECTORS = 4


class Softmax(ScheduleRule):
    """[prologue] -> row max -> exp -> row sum -> normalize [-> epilogue], over the last axis."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        if sch is None or not is_softmax(sch):
            return None
        try:
            if not _schedule(sch, target):
                return None
        except s_tir.ScheduleError:
            return None  # prologue/epilogue blocks that do not follow the rows: not this rule's shape
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)  # a few symbolic rows: one core


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    """Schedule in place; False if the output is not laid out as the reduced rows."""
    inline_cheap_blocks(sch)
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    reductions = [block for block in blocks if not is_spatial(sch.get(block))]
    row_domain = [extent_of(iv.dom.extent) for iv in sch.get(reductions[0]).iter_vars]
    lanes = vector_lanes(target, str(sch.get(reductions[0]).writes[0].source.dtype))
    output = blocks[-1]
    *rows, columns = sch.get_loops(output)
    if not same_extents([extent(sch, loop) for loop in rows], row_domain[:-1]) or not _reduces_row(
            extent(sch, columns), row_domain[-1]):
        return False
    # Symbolic rows are only a parallel loop of unknown length; a symbolic row length keeps
    # scalar reductions (a partial-sum vector would need a predicate on every lane).
    static_columns = isinstance(row_domain[-1], int)
    partial_lanes = partial_width(row_domain[-1], lanes) if static_columns else 1
    partials = []
    if partial_lanes >= _MIN_REDUCTION_LANES:
        for block in reductions:
            _, lane = sch.split(sch.get_loops(block)[-1], [None, partial_lanes])
            partials.append(sch.get(sch.rfactor(lane, len(row_domain) - 1)).name_hint)
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    row = sch.fuse(*rows)
    parallel_rows(sch, row)
    for block in reversed(blocks[:-1]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    for block in blocks:
        if sch.get(block).name_hint in partials:
            _vectorize_partial(sch, block)
        elif is_spatial(sch.get(block)):
            _vectorize_row(sch, block, lanes)
    return True


def _reduces_row(columns, reduced) -> bool:
    """Whether reductions over ``reduced`` elements cover a row of ``columns``: the same
    length, or the row padded to whole vectors (``kernels/padded_softmax.py``)."""
    if same_extents([columns], [reduced]):
        return True
    return isinstance(columns, int) and isinstance(reduced, int) and reduced == padded_width(columns)


def _vectorize_partial(sch: s_tir.Schedule, block) -> None:
    """The rfactor block: reduce over the vectors of the row with the lanes innermost, in a vector."""
    lane_var = get_sblockrealize(sch, block).iter_values[0]  # rfactor puts its new axis first
    loops = sch.get_loops(block)
    lane = next(loop for loop in loops if sch.get(loop).loop_var.same_as(lane_var))
    reduce_loop = loops[-1]
    sch.reorder(reduce_loop, lane)
    sch.vectorize(lane)
    vectorized_init(sch, block, reduce_loop)


def _vectorize_row(sch: s_tir.Schedule, block, lanes: int) -> None:
    innermost = sch.get_loops(block)[-1]
    length = extent(sch, innermost)
    if not isinstance(length, int) or length < 2:
        return  # a symbolic row length: a predicated vector would run scalar
    if length > lanes and length % lanes == 0:
        innermost = sch.split(innermost, [None, lanes])[1]
    elif length > _MAX_ROW_VECTORS * lanes:
        width = partial_width(length, lanes)
        if width < _MIN_REDUCTION_LANES:
            # whole vectors, then the few elements left as one short vector
            whole, tail = sch.loop_partition(innermost, [length - length % lanes, None])
            sch.vectorize(sch.split(whole, [None, lanes])[1])
            innermost = tail
        else:
            innermost = sch.split(innermost, [None, width])[1]
    sch.vectorize(innermost)


def partial_width(columns: int, lanes: int) -> int:
    """Lanes of the partial max/sum vectors of a row of ``columns``: the largest power of two
    dividing it, at most one vector register; when that is under ``_MIN_REDUCTION_LANES``, the
    largest divisor between half and twice a register that leaves at least two steps (25 of
    6625); else 1 (scalar reductions)."""
    width = power_of_two_width(columns, lanes)
    if width >= _MIN_REDUCTION_LANES:
        return width
    divisors = [d for d in range(lanes // 2, 2 * lanes + 1) if columns % d == 0 and columns >= 2 * d]
    return max(divisors, default=width)
