"""All-spatial functions (element-wise, broadcast, transpose, reshape, gather, concat...)."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .inline import inline_cheap_blocks, is_spatial
from .target_info import vector_lanes

# Below this many elements a parallel launch costs more than the loop itself.
_MIN_PARALLEL_ELEMENTS = 4096


class Injective(ScheduleRule):
    """Fuse each output's loops into one, run vectors innermost and chunks of them across cores."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        if not all(is_spatial(sch.get(b)) for b in sch.get_child_blocks(get_root_block(sch))):
            return None
        inline_cheap_blocks(sch)
        for block in sch.get_child_blocks(get_root_block(sch)):
            loops = sch.get_loops(block)
            if not loops:
                continue
            if any(not isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops):
                continue  # symbolic extents: left as written, still correct
            dtype = sch.get(block).writes[0].source.dtype
            _parallel_vectorize(sch, sch.fuse(*loops), vector_lanes(target, dtype))
        return sch



def _parallel_vectorize(sch: s_tir.Schedule, loop, lanes: int) -> None:
    extent = int(sch.get(loop).extent)
    if extent % lanes == 0 and extent > lanes:
        loop, vector = sch.split(loop, [None, lanes])
        sch.vectorize(vector)
    if extent >= _MIN_PARALLEL_ELEMENTS:
        sch.parallel(loop)
