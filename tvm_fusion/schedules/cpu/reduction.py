"""Row reductions (softmax, layer norm, RMS norm) computed one row at a time, rows across cores."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .inline import inline_cheap_blocks, same_extents
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small
from .target_info import vector_lanes


class Reduction(ScheduleRule):
    """Blocks that all share leading row axes and reduce only over trailing axes.

    Every block is computed under the output's row loop, so the row's intermediates
    (max, exp, sum, mean) stay in cache; the row loop runs in parallel, the inner
    element-wise loops run on vectors, and sums are split into vector-wide partial sums.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        inline_cheap_blocks(sch)
        blocks = normalize_prim_func(sch)
        if blocks is None or all(block.is_injective() for block in blocks):
            return None
        if any(not _is_row_shaped(block) for block in blocks):
            return None
        row_axes = min(_leading_spatial(block) for block in blocks)
        if row_axes == 0 or not _same_rows(blocks, row_axes):
            return None  # blocks disagree on the rows: computing them per row would be wrong
        dtype = sch.get(blocks[-1].block_rv).writes[0].source.dtype
        lanes = vector_lanes(target, dtype)

        output = blocks[-1].block_rv
        row = sch.fuse(*sch.get_loops(output)[:row_axes])
        sch.parallel(row)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block.block_rv, row, preserve_unit_loops=True)
        for block in blocks:
            _vectorize_innermost(sch, block.block_rv, row, lanes)
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)  # a few symbolic rows: one core


def _leading_spatial(block: SBlockInfo) -> int:
    kinds = block.dom_kind()
    return len(kinds) - len(kinds.lstrip("S"))


def _is_row_shaped(block: SBlockInfo) -> bool:
    """Spatial axes first, then only reduction axes: S..S R..R."""
    kinds = block.dom_kind()
    return bool(kinds) and kinds.rstrip("R") == kinds[: _leading_spatial(block)]


def _same_rows(blocks: list[SBlockInfo], row_axes: int) -> bool:
    """True if every block has the same leading row extents (ints, or symbolic row counts)."""
    first = _row_extents(blocks[:1], row_axes)
    return all(same_extents(_row_extents([block], row_axes), first) for block in blocks[1:])


def _row_extents(blocks: list[SBlockInfo], row_axes: int) -> list:
    return [
        int(extent) if isinstance(extent, tirx.IntImm) else extent
        for block in blocks
        for extent in block.dom()[:row_axes]
    ]


def _vectorize_innermost(sch: s_tir.Schedule, block, row, lanes: int) -> None:
    """Vectorize an element-wise loop inside the row; leave reduction loops scalar.

    A block with no loop of its own below the row (a global mean's divide) is left alone:
    splitting the row loop would put the row's reductions inside a vector loop.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if stmt.iter_vars[-1].iter_type != tirx.IterVar.DataPar or sch.get(loops[-1]).same_as(sch.get(row)):
        return
    innermost = loops[-1]
    extent = sch.get(innermost).extent
    if not isinstance(extent, tirx.IntImm) or int(extent) < 2:
        return
    if int(extent) > lanes and int(extent) % lanes == 0:
        innermost = sch.split(innermost, [None, lanes])[1]
    sch.vectorize(innermost)
