"""PRelu with a constant slope -> ``max(x, 0) + min(x, 0) * slope``, the slope laid out to broadcast.

TVM imports ONNX PRelu as ``nn.prelu(x, slope, axis)`` when the slope is one value per channel
and as ``where(x < 0, x * slope, x)`` otherwise (a Keras slope per pixel and channel).
``nn.prelu`` carries its channel axis as an attribute, which the blocked conv layout cannot
split into NCHW[x]c, and ``where`` has no layout inference in TVM: either way the layout went
back to NCHW around each PRelu and no epilogue fusion took it. The canonical form is made of
ops that every layout pass and SinkViews carry, on a constant laid out like a bias, so the conv
and matmul epilogues fuse it. It equals PRelu bit for bit: for x < 0 it is ``0 + x * slope``,
otherwise ``x + 0`` (a NaN input gives 0, as ``relu`` already does in TVM).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, close_to, non_float_reason, scalar_constant, shape_dims


class PreluCanonical(RewriteRule):
    name = "prelu"
    description = "nn.prelu(x, slope) or where(x < 0, x * slope, x), constant slope -> max(x, 0) + min(x, 0) * slope"

    def variants(self):
        x, slope = wildcard(), is_const()
        prelu = is_op("relax.nn.prelu")(x, slope)
        x_where, slope_where, zero = wildcard(), is_const(), is_const()
        selected = is_op("relax.where")(is_op("relax.less")(x_where, zero),
                                        is_op("relax.multiply")(x_where, slope_where), x_where)
        return [(prelu, {"x": x, "slope": slope, "prelu": prelu}),
                (selected, {"x": x_where, "slope": slope_where, "zero": zero})]

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        x_shape, slope_shape = shape_dims(matched["x"]), shape_dims(matched["slope"])
        if x_shape is None or slope_shape is None:
            return "the input's or the slope's rank is not known"
        if "zero" in matched and not close_to(scalar_constant(matched["zero"]), 0.0):
            return f"the where compares x with {scalar_constant(matched['zero'])}, not 0"
        if "prelu" not in matched and len(slope_shape) > len(x_shape):
            return f"the slope (rank {len(slope_shape)}) has more axes than the input (rank {len(x_shape)})"
        return None

    def rewrite(self, matched):
        x = matched["x"]
        dtype = str(x.ty.dtype)
        slope = matched["slope"].value.numpy().astype(dtype)
        if "prelu" in matched:  # one value (or one per channel along the op's axis)
            slope = slope.reshape(-1)
            rank = len(shape_dims(x))
            shape = [1] * rank
            if slope.size > 1:
                shape[int(matched["prelu"].attrs.axis) % rank] = slope.size
            slope = slope.reshape(shape)
        zero = relax.const(0, dtype)
        return relax.op.add(relax.op.maximum(x, zero),
                            relax.op.multiply(relax.op.minimum(x, zero), relax.const(np.ascontiguousarray(slope), dtype)))
