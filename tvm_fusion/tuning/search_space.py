"""MetaSchedule's search space for our kernels, with our dot-product intrinsics as the tensorize
candidates of the int8 and bf16 kernels.

On a VNNI target MetaSchedule's own x86 space tensorizes a uint8 x int8 sum with TVM's
``dot_16x4_vnni``, whose ``vpdpbusd`` call has the i32 operand types the LLVM in TVM 0.27
rejects: every such candidate fails to build, so the int8 kernels were searched without the
instruction their hand schedules use. Its space has no bf16 candidate at all. Here the space is
MetaSchedule's CPU rules with multi-level tiling around our intrinsics (``Int8MatmulVnni``'s and
``Bf16MatmulAvx512``'s) ahead of the plain tiling, and the tensorizing postprocessor; a bf16
candidate also imports the LLVM IR its intrinsic calls (``kernels/avx512_bf16.py``), a step the
record's trace keeps, so compile replays it with the rest.
"""

from __future__ import annotations

import tvm_ffi
from tvm.ir.expr import Call, StringImm
from tvm.ir.utils import derived_object
from tvm.s_tir import SBlockRealize, Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target
from tvm.tirx import ForKind

from ..kernels.avx512_bf16 import DPBF16PS_FUNCTION, DPBF16PS_LLVM, IMPORT_ANNOTATION
from ..kernels.cpu_features import has_avx512_bf16, has_vnni
from ..schedules.cpu.bf16_matmul_avx512 import DPBF16PS_INTRIN
from ..schedules.cpu.int8_matmul_vnni import VNNI_INTRIN

AUTO_TENSORIZE = "meta_schedule.auto_tensorize"  # MultiLevelTilingWithIntrin's mark on a block to tensorize


def dot_intrinsics(target: Target) -> list[str]:
    """Our tensor intrinsics the target's kernels can be tensorized with (int8 first)."""
    if target.kind.name != "llvm":
        return []
    return [name for name, present in ((VNNI_INTRIN, has_vnni(target)), (DPBF16PS_INTRIN, has_avx512_bf16(target)))
            if present]


def space_generator(target: Target) -> ms.space_generator.PostOrderApply | str:
    """The design space of a kernel on ``target``: MetaSchedule's own where no intrinsic of ours
    applies; otherwise its CPU rules with our intrinsics' tiling before the plain tiling."""
    intrinsics = dot_intrinsics(target)
    if not intrinsics:
        return "post-order-apply"
    write_cache = ms.schedule_rule.ReuseType(req="must", levels=[1, 2], scope="local")
    rules = []
    for rule in ms.ScheduleRule.create("llvm"):
        if isinstance(rule, ms.schedule_rule.MultiLevelTiling):
            rules += [ms.schedule_rule.MultiLevelTilingWithIntrin(name, structure="SSRSRS", max_innermost_factor=64,
                                                                  reuse_write=write_cache)
                      for name in intrinsics]
        rules.append(rule)
    postprocs = []
    for postproc in ms.Postproc.create("llvm"):
        if isinstance(postproc, ms.postproc.RewriteLayout):
            postprocs.append(ms.postproc.RewriteTensorize(vectorize_init_loop=True))
        postprocs.append(postproc)
        if isinstance(postproc, ms.postproc.RewriteParallelVectorizeUnroll):
            postprocs.append(UnrollTensorizedTiles())
    postprocs.append(ImportCalledLlvm())
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=postprocs, mutator_probs="llvm")


@derived_object
class UnrollTensorizedTiles(ms.postproc.PyPostproc):
    """Unroll, not vectorize, the loops around a block to be tensorized (a tile's column blocks).

    MetaSchedule's vectorizing postprocessor vectorizes the innermost spatial loops of every
    block, and a vectorized loop around the intrinsic's vector code fails to build ("Cannot
    broadcast", "VectorizeLoop before LiftStorageAlloc"). Unrolled, each column block keeps its
    accumulators in registers, as the hand schedule's register tiles do."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: Schedule) -> bool:
        realizes: list[SBlockRealize] = []
        tvm_ffi.structural_walk(sch.mod["main"].body, (SBlockRealize, realizes.append))
        for realize in (r for r in realizes if AUTO_TENSORIZE in r.block.annotations):
            for loop in sch.get_loops(sch.get_sblock(realize.block.name_hint)):
                if sch.get(loop).kind == ForKind.VECTORIZED:
                    sch.unroll(loop)
        return True

    def clone(self) -> ms.postproc.Postproc:
        return UnrollTensorizedTiles()


@derived_object
class ImportCalledLlvm(ms.postproc.PyPostproc):
    """A kernel tensorized with ``vdpbf16ps`` calls a function of LLVM IR: link it in by the
    import annotation on the kernel's first loop, as the hand schedule does."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch: Schedule) -> bool:
        calls: list[Call] = []
        tvm_ffi.structural_walk(sch.mod["main"].body, (Call, calls.append))
        if not any(_is_call_of(call, DPBF16PS_FUNCTION) for call in calls):
            return True
        looped = next((loops for block in sch.get_child_blocks(sch.get_sblock("root"))
                       if (loops := sch.get_loops(block))), None)
        if looped is None:
            return False
        sch.annotate(looped[0], IMPORT_ANNOTATION, DPBF16PS_LLVM)
        return True

    def clone(self) -> ms.postproc.Postproc:
        return ImportCalledLlvm()


def _is_call_of(call: Call, extern: str) -> bool:
    return (call.op.name == "tirx.call_extern" and isinstance(call.args[0], StringImm)
            and call.args[0].value == extern)
