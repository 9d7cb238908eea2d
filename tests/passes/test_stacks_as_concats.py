"""stacks_as_concats / concats_as_stacks: a stack becomes the concat of its inputs with the new
axis inserted (what TVM's layout inference can carry) and comes back as the same stack."""

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes.stacks_as_concats import concats_as_stacks, stacks_as_concats


def _ops(mod: tvm.IRModule) -> list[str]:
    ops = []
    relax.analysis.post_order_visit(mod["main"], lambda e: ops.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return ops


def test_a_stack_passes_as_a_concat_and_comes_back():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                gv = R.stack((a, b), axis=1)
                R.output(gv)
            return gv

    concats = stacks_as_concats(Before)
    assert _ops(concats) == ["relax.expand_dims", "relax.expand_dims", "relax.concat"]
    assert _ops(Before) == ["relax.stack"]  # a new module: the caller keeps the old one
    tvm.ir.assert_structural_equal(concats_as_stacks(concats), Before)


def test_a_concat_of_other_values_stays():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                gv = R.concat((a, b), axis=1)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(concats_as_stacks(Before), Before)
    tvm.ir.assert_structural_equal(stacks_as_concats(Before), Before)
