"""ONNX Max/Min of two tensors, as TVM imports them -> ``maximum``/``minimum``.

TVM's importer writes an element-wise ``Max(a, b)`` as ``max(stack((broadcast_to(a, S),
broadcast_to(b, S))), axis=0)``: a copy of both operands, then a reduction. tf2onnx writes
``Max`` for ``tf.maximum``, so jax2tf's LayerNorm clamps its variance with it
(``max(0, E[x^2] - E[x]^2)``) and its softmax its row maximum. As the element-wise op, with
a broadcast that changes nothing dropped and a constant of one value as a scalar, it is what the
norm and softmax patterns (and every other element-wise consumer) read.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, is_tuple, wildcard

from .base import RewriteRule, non_float_reason, same_dims, shape_dims

REDUCTIONS = {"relax.max": relax.op.maximum, "relax.min": relax.op.minimum}


class StackedMaxMin(RewriteRule):
    name = "stacked_max_min"
    description = "max/min over axis 0 of a stack of two tensors (ONNX Max/Min of two) -> maximum/minimum"

    def variants(self):
        variants = []
        for reduction in REDUCTIONS:
            first, second = wildcard(), wildcard()
            stacked = is_op("relax.stack")(is_tuple([first, second]))
            reduced = is_op(reduction)(stacked)
            variants.append((reduced, {"first": first, "second": second, "stacked": stacked, "reduced": reduced}))
        return variants

    def check(self, matched):
        stacked, reduced = matched["stacked"], matched["reduced"]
        if int(stacked.attrs.axis) != 0:
            return f"the stack is along axis {int(stacked.attrs.axis)}, not 0"
        axes = reduced.attrs.axis
        if axes is None or [int(a) for a in axes] != [0] or reduced.attrs.keepdims:
            return "the reduction is not over the stacked axis alone"
        return non_float_reason(matched["first"]) or non_float_reason(matched["second"])

    def rewrite(self, matched):
        op = REDUCTIONS[matched["reduced"].op.name]
        first, second = _unbroadcast(matched["first"]), _unbroadcast(matched["second"])
        shape = shape_dims(matched["first"])  # both operands of a stack have one shape
        # A constant of one value becomes a scalar where the other operand keeps the shape.
        if isinstance(second, tvm.ir.GenericConst) and same_dims(shape_dims(first), shape):
            second = _scalar_if_uniform(second)
        elif isinstance(first, tvm.ir.GenericConst) and same_dims(shape_dims(second), shape):
            first = _scalar_if_uniform(first)
        return op(first, second)


def _unbroadcast(expr: relax.Expr) -> relax.Expr:
    """``expr`` without a broadcast to its own shape."""
    if (isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.broadcast_to")
            and same_dims(shape_dims(expr.args[0]), shape_dims(expr))):
        return expr.args[0]
    return expr


def _scalar_if_uniform(expr: relax.Expr) -> relax.Expr:
    if not isinstance(expr, tvm.ir.GenericConst):
        return expr
    value = expr.value.numpy()
    if value.size == 0 or not np.all(value == value.flat[0]):
        return expr
    return relax.const(value.flat[0], str(value.dtype))
