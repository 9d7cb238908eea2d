"""Mish, ``x * tanh(softplus(x))``, as one composite whatever way the exporter spelled softplus.

TVM imports ONNX Mish as ``x * tanh(log(1 + exp(x)))`` and ONNX Softplus (what exporters below
opset 18 write Mish with) as the overflow-safe ``max(x, 0) + log(1 + exp(-|x|))``. Both are
matched; the composite becomes one kernel that ``schedule.MishKernel`` schedules.
"""

from __future__ import annotations

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_const, is_op, wildcard

from tvm_fusion.patterns.base import FusionRule, close_to, non_float_reason, scalar_constant


class Mish(FusionRule):
    name = "mish"
    description = "x * tanh(softplus(x)) (Mish, either softplus spelling) -> one kernel"
    # Mish after a conv is an activation the conv epilogue does not know: let it have the conv.
    runs_after = ("conv_epilogue",)

    def variants(self):
        x, one, zero = wildcard(), is_const(), is_const()
        plain = is_op("relax.log")(is_op("relax.add")(one, is_op("relax.exp")(x)))
        stable = is_op("relax.add")(
            is_op("relax.maximum")(x, zero),
            is_op("relax.log")(is_op("relax.add")(one, is_op("relax.exp")(is_op("relax.negative")(is_op("relax.abs")(x))))))
        return [(name, is_op("relax.multiply")(x, is_op("relax.tanh")(softplus)), {"x": x, "one": one, **extra})
                for name, softplus, extra in (("mish_stable_softplus", stable, {"zero": zero}),
                                              ("mish", plain, {}))]

    def check(self, context):
        found = context.annotated_expr
        if not close_to(scalar_constant(found["one"]), 1.0):
            return "the constant added before the log is not 1"
        if "zero" in found and not close_to(scalar_constant(found["zero"]), 0.0):
            return "the softplus's maximum is not with 0"
        reason = non_float_reason(found["x"])
        if reason is not None:
            return reason
        if has_leaking_intermediate_variables(context):
            return "an intermediate (the softplus or its tanh) is also used outside the chain"
        return None
