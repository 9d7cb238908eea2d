"""Softmax over flattened rows -> softmax on the tensor itself.

paddle2onnx writes the attention softmax of SVTR (PP-OCR's recognizers) as Reshape to
[batch*heads*queries, keys], Softmax, Reshape back. A softmax over the last axis does not
depend on how the leading axes are grouped, so the reshapes are copies that only hide the
attention chain from the ``attention`` and ``softmax`` fusions.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule, non_float_reason, static_shape


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
        shape, flat = static_shape(matched["x"]), static_shape(matched["flat"])
        if shape is None or flat is None:
            return "the shapes are not static (bind the dynamic dims)"
        if int(matched["probs"].attrs.axis) not in (-1, len(flat) - 1):
            return f"softmax is over axis {int(matched['probs'].attrs.axis)}, not the last"
        if not shape or flat[-1] != shape[-1] or math.prod(flat) != math.prod(shape):
            return f"the reshape {shape} -> {flat} changes the softmax axis"
        if static_shape(matched["result"]) != shape:
            return f"the result is reshaped to {static_shape(matched['result'])}, not back to {shape}"
        return None

    def rewrite(self, matched):
        return relax.op.nn.softmax(matched["x"], axis=-1)
