"""cpu_schedule: the rules asking in turn for one kernel with its cheap blocks inlined get
independent copies of one inlining, each with the full trace from the kernel."""

import tvm
from tvm import te
from tvm.target import Target

from tvm_fusion.schedules.cpu.helpers import cpu_schedule

TARGET = Target({"kind": "llvm", "num-cores": 2})


def _scale_then_shift(scale: float = 2.0):
    a = te.placeholder((64, 64), name="a")
    scaled = te.compute((64, 64), lambda i, j: a[i, j] * scale, name="scaled")
    shifted = te.compute((64, 64), lambda i, j: scaled[i, j] + 1.0, name="shifted")
    return te.create_prim_func([a, shifted])


def test_each_rule_gets_its_own_copy_with_the_inlining_traced():
    func = _scale_then_shift()
    first, second = (cpu_schedule(func, TARGET, inline_cheap=True) for _ in range(2))
    for sch in (first, second):
        assert [inst.kind.name for inst in sch.trace.insts][-1] == "ComputeInline"
        assert [b.name_hint for b in (sch.get(x) for x in sch.get_child_blocks(sch.get_sblock("root")))] == ["shifted"]
    first.vectorize(first.get_loops(first.get_sblock("shifted"))[-1])
    assert len(first.trace.insts) > len(second.trace.insts)  # what one rule does, the next does not see
    assert "vectorized" not in second.mod.script()


def test_another_kernel_is_inlined_anew():
    cpu_schedule(_scale_then_shift(2.0), TARGET, inline_cheap=True)
    other = _scale_then_shift(3.0)
    sch = cpu_schedule(other, TARGET, inline_cheap=True)
    tvm.ir.assert_structural_equal(_replayed(other), sch.mod)  # the 3.0 kernel, not the cached 2.0 one


def _replayed(func):
    sch = tvm.s_tir.Schedule(func)
    sch.compute_inline(sch.get_sblock("scaled"))
    return sch.mod
