"""Sum a block's innermost reduction into one vector of partial sums, then reduce the vector."""

from tvm import s_tir

from .helpers import extent, iter_kinds, vectorized_init


def vectorize_reduction(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """Rewrite ``out[s] += f(s, r)`` (reduction loops innermost) as ``lanes`` running partial
    sums updated by one vector add/FMA per step, and a final horizontal sum.

    A scalar reduction loop is one long dependency chain of adds; split across vector lanes it
    runs ``lanes`` chains at once from contiguous loads. Returns False (block untouched) when
    the reduction is too short or not a multiple of ``lanes``.
    """
    kinds = iter_kinds(sch.get(block))
    spatial = len(kinds) - len(kinds.lstrip("S"))
    reductions = len(kinds) - spatial
    loops = sch.get_loops(block)
    if reductions == 0 or kinds != "S" * spatial + "R" * reductions or len(loops) <= reductions:
        return False
    reduction = loops[-reductions:]
    total = 1
    for loop in reduction:
        total *= extent(sch, loop)
    if total % lanes or total < 2 * lanes:
        return False
    fused = sch.fuse(*reduction) if len(reduction) > 1 else reduction[0]
    _, lane = sch.split(fused, [None, lanes])
    partial = sch.rfactor(lane, factor_axis=spatial)
    *_, partial_outer, partial_lane = sch.get_loops(partial)
    sch.vectorize(partial_lane)
    vectorized_init(sch, partial, partial_outer)
    return True
