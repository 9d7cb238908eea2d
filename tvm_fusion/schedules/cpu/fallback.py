"""Last resort: run the outer spatial loops of every block across cores, and nothing riskier."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr, get_root_block
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small


class Fallback(ScheduleRule):
    """Parallelize each root block's leading loops that bind only data-parallel axes.

    Always answers, so every function leaves the pipeline marked scheduled; a block with
    no such loop is left as written, which is slow but correct.
    """

    runs_after = ("*",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(get_root_block(sch)):
            leading = _leading_spatial_loops(sch, block)
            if not leading:
                continue
            try:
                sch.parallel(sch.fuse(*leading))
            except s_tir.ScheduleError:
                continue  # parallel refuses blocks with an opaque axis (a scan): left serial
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)


def _leading_spatial_loops(sch: s_tir.Schedule, block) -> list:
    """The outermost perfectly nested loops (static or symbolic) that feed only data-parallel block axes."""
    stmt = sch.get(block)
    realize = get_sblockrealize(sch, block)
    reduction_vars = set()
    for iter_var, value in zip(stmt.iter_vars, realize.iter_values):
        if iter_var.iter_type != tirx.IterVar.DataPar:
            reduction_vars |= collect_vars_used_in_prim_expr(value)
    leading = []
    for loop in sch.get_loops(block):
        loop_stmt = sch.get(loop)
        if loop_stmt.loop_var in reduction_vars:
            break
        leading.append(loop)
        if not isinstance(loop_stmt.body, tirx.For):
            break  # whatever follows is not perfectly nested under this loop
    return leading
