"""The CPU schedule of the Mish kernel: one pass, vectors innermost, chunks across cores.

A kernel of its own gets a rule of its own: this one answers only for a function whose output
is ``x * tanh(...)`` of an element-wise chain holding a ``log`` (the Mish composite after
FuseTIR) and leaves everything else to the built-in rules.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from tvm_fusion.targets.target_info import vector_lanes

MIN_PARALLEL = 4096  # below this many elements a second core costs more than it saves


class MishKernel(ScheduleRule):
    target_kinds = ("llvm",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        if not _computes_mish(sch):
            return None
        *producers, output = sch.get_child_blocks(get_root_block(sch))
        try:
            for block in reversed(producers):
                sch.compute_inline(block)
            loops = sch.get_loops(output)
            if not all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops):
                return None  # symbolic extents: the built-in Injective rule handles those
            fused = sch.fuse(*loops)
            extent = int(sch.get(fused).extent)
            lanes = vector_lanes(target, sch.get(output).writes[0].source.dtype)
            if extent % lanes == 0:
                fused, vector = sch.split(fused, [None, lanes])
                sch.vectorize(vector)
            if extent >= MIN_PARALLEL:
                sch.parallel(fused)
        except s_tir.ScheduleError:
            return None
        return sch


def _computes_mish(sch: s_tir.Schedule) -> bool:
    """One output, every block element-wise, a ``log`` inside (tanh and exp may be fast-math
    polynomials by now), and the last block ``x * (...)`` with ``x`` an input."""
    blocks = [sch.get(block) for block in sch.get_child_blocks(get_root_block(sch))]
    if not blocks or any(iv.iter_type != tirx.IterVar.DataPar for b in blocks for iv in b.iter_vars):
        return False
    calls = []
    tvm_ffi.structural_walk(sch.mod["main"].body, (Call, calls.append))
    if "tirx.log" not in {str(call.op.name) for call in calls if hasattr(call.op, "name")}:
        return False
    value = blocks[-1].body.value if isinstance(blocks[-1].body, tirx.BufferStore) else None
    written = [w.source for b in blocks for w in b.writes]
    internal = list(sch.get(get_root_block(sch)).alloc_buffers)
    outputs = [buf for buf in written if not any(buf.same_as(i) for i in internal)]
    return len(outputs) == 1 and isinstance(value, tirx.Mul) and any(
        isinstance(operand, TensorLoad) and not any(operand.source.same_as(w) for w in written)
        for operand in (value.a, value.b))
