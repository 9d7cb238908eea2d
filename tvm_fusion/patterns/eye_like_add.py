"""EyeLike + Add -> AddEyeLike: add the k-th diagonal's ones without storing the identity.

TVM imports EyeLike as ``R.eye_like``, which constant-folding turns into an n x m tensor baked
into the library and streamed from memory by the add. The frontend instead emits
``call_tir(eye_like, (x,))`` from ``kernels/eye_like.py`` (a kernel on its input, as ONNX
Runtime runs it). This fusion groups it with the Add into one kernel, in which the identity is
``Select(j - i == k, 1, 0)``: the ``Injective`` schedule inlines it into the add's vectorized
loop, one read and one write per element (the seed's worked example).
"""

from __future__ import annotations

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, is_tuple, wildcard

from ..kernels.eye_like import KERNEL_NAME
from .base import FusionRule, dims_text, same_dims, shape_dims


class EyeLikeAdd(FusionRule):
    name = "eye_like_add"
    runs_before = ("gemm_epilogue",)
    description = "EyeLike + Add (operand of the identity's shape) -> one kernel"

    kernels = {"kernel": KERNEL_NAME}  # our kernel, told by its tvm_fusion.kernel attribute

    def variants(self):
        kernel, x, other = wildcard(), wildcard(), wildcard()
        eye = is_op("relax.call_tir")(kernel, is_tuple([x]))
        return [("add_eye_like", is_op("relax.add")(eye, other),
                 {"kernel": kernel, "x": x, "eye": eye, "other": other})]

    def anchor(self, context):
        return context.annotated_expr["eye"]

    def check(self, context):
        found = context.annotated_expr
        # The identity is computed from the indices, so its dims may be symbolic; the add must
        # not broadcast (the other operand has the identity's very shape: ``n`` with ``n``).
        eye_shape, other_shape = shape_dims(found["eye"]), shape_dims(found["other"])
        if eye_shape is None:
            return "the identity's rank is not known"
        if not same_dims(other_shape, eye_shape):
            return (f"the other operand of the add, shape {dims_text(other_shape)}, does not match the "
                    f"identity's shape {dims_text(eye_shape)} (the add would broadcast)")
        if has_leaking_intermediate_variables(context):
            return "the identity is also used outside the add"
        return None
