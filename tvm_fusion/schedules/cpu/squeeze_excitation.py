"""Squeeze-and-excitation gate kernel: global average pool, then two 1x1 convs on the pooled
vector (``patterns/squeeze_excitation.py`` fuses them into one function).

Almost all of the work is the pool (a pass over the whole map); the convs and activations
after it touch one value per channel. The pool sums each channel's contiguous map in vector
partial sums, channels across cores; each conv is a dot product per output channel over the
input channels, whose weight row is contiguous, so it gets vector partial sums as well.
Over a symbolic map (a model compiled for a range of sizes) the pool is one scalar sum per
channel: vector partial sums need the map size to divide by the vector. In the blocked layout
(NCHW[x]c) the channels of a block are the contiguous axis: the pool adds whole vectors.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...targets.target_info import vector_lanes
from .helpers import cpu_schedule, extent, has_static_extents, iter_kinds
from .symbolic_width import static_except
from .vector_sum import vectorize_reduction

# Output elements per block above which the per-channel tail is worth spreading over cores.
_PARALLEL_TAIL_MACS = 1 << 16


class SqueezeExcitation(ScheduleRule):
    """``mean over H, W`` (S S S S R R, output N x C x 1 x 1, or S S S S S R R in NCHW[x]c)
    followed by reductions that work on the pooled vector only (no spatial extent beyond N x C)."""

    runs_before = ("Pooling",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target, inline_cheap=True)
        if sch is None:
            return None
        blocks = sch.get_child_blocks(get_root_block(sch))
        reductions = [b for b in blocks if not is_spatial(sch.get(b))]
        if len(reductions) < 2 or not blocks[0].same_as(reductions[0]):
            return None
        pool = sch.get(reductions[0])
        blocked = iter_kinds(pool) == "SSSSSRR"  # NCHW[x]c: the channel block is the 5th axis
        if iter_kinds(pool) not in ("SSSSRR", "SSSSSRR") or not static_except(pool, (5, 6) if blocked else (4, 5)):
            return None
        if [int(iv.dom.extent) for iv in pool.iter_vars[2:4]] != [1, 1]:
            return None  # not a global pool: the output keeps a spatial map
        if any(not has_static_extents(sch.get(b)) or _spatial_size(sch.get(b)) > _spatial_size(pool)
               for b in blocks[1:]):
            return None  # the tail must work on the pooled vector, not on a map
        lanes = vector_lanes(target, pool.writes[0].source.dtype)
        if blocked:
            self._schedule_blocked_pool(sch, reductions[0], lanes)
        else:
            self._schedule_pool(sch, reductions[0], lanes)
        for block in reductions[1:]:
            self._schedule_tail_reduction(sch, block, lanes)
        return sch

    @staticmethod
    def _schedule_pool(sch: s_tir.Schedule, pool, lanes: int) -> None:
        channels = sch.fuse(*sch.get_loops(pool)[:4])
        if has_static_extents(sch.get(pool)):
            vectorize_reduction(sch, pool, lanes)
        sch.parallel(channels)

    @staticmethod
    def _schedule_blocked_pool(sch: s_tir.Schedule, pool, lanes: int) -> None:
        """Rows and columns summed into one vector per channel block: the block's channels are
        contiguous, so each step is one vector load and add."""
        batch, channels, row, column, lane, rows, columns = sch.get_loops(pool)
        sch.reorder(rows, columns, lane)
        outer = sch.fuse(batch, channels, row, column)
        # Annotated before the init is split off: the update alone is not a reduction block.
        if extent(sch, lane) % lanes == 0:
            sch.vectorize(lane)
        sch.parallel(outer)
        sch.decompose_reduction(pool, rows)

    @staticmethod
    def _schedule_tail_reduction(sch: s_tir.Schedule, block, lanes: int) -> None:
        stmt = sch.get(block)
        spatial = sum(1 for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar)
        outputs = sch.fuse(*sch.get_loops(block)[:spatial])
        macs = 1
        for iv in stmt.iter_vars:
            macs *= int(iv.dom.extent)
        vectorize_reduction(sch, block, lanes)
        if macs >= _PARALLEL_TAIL_MACS and extent(sch, outputs) > 1:
            sch.parallel(outputs)


def _spatial_size(block: s_tir.SBlock) -> int:
    size = 1
    for iv in block.iter_vars:
        if iv.iter_type == tirx.IterVar.DataPar:
            size *= int(iv.dom.extent)
    return size
