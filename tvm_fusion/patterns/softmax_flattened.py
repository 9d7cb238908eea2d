"""Softmax over flattened rows -> softmax on the tensor itself.

paddle2onnx writes the attention softmax of SVTR (PP-OCR's recognizers) as Reshape to
[batch*heads*queries, keys], Softmax, Reshape back. A softmax over the last axis does not
depend on how the leading axes are grouped, so the reshapes are copies that only hide the
attention chain from the ``attention`` and ``softmax`` fusions.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule, dims_text, non_float_reason, same_dim, same_dims, same_size, shape_dims


class SoftmaxFlattened(RewriteRule):
    name = "softmax_flattened"
    description = "reshape (merging leading axes) -> softmax(last axis) -> reshape back -> softmax"
    exclusive = ("flat", "probs")

    def variants(self):
        x = wildcard()
        flat = is_op("relax.reshape")(x, wildcard())
        probs = is_op("relax.nn.softmax")(flat)
        result = is_op("relax.reshape")(probs, wildcard())
        return [(result, {"x": x, "flat": flat, "probs": probs, "result": result})]

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        shape, flat = shape_dims(matched["x"]), shape_dims(matched["flat"])
        if not shape or not flat:
            return "the ranks of the reshape's input and output are not known"
        if int(matched["probs"].attrs.axis) not in (-1, len(flat) - 1):
            return f"softmax is over axis {int(matched['probs'].attrs.axis)}, not the last"
        # Symbolic leading dims (batch, sequence) are fine: only the products must provably agree.
        if not same_dim(flat[-1], shape[-1]) or not same_size(flat, shape):
            return f"the reshape {dims_text(shape)} -> {dims_text(flat)} changes the softmax axis"
        result = shape_dims(matched["result"])
        if not same_dims(result, shape):
            return f"the result is reshaped to {dims_text(result)}, not back to {dims_text(shape)}"
        return None

    def rewrite(self, matched):
        return relax.op.nn.softmax(matched["x"], axis=-1)
