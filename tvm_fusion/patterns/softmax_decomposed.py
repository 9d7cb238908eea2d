"""Exporter-decomposed stable softmax (jax's ``jax.nn.softmax`` through jax2tf) -> ``R.nn.softmax``.

jax writes ``softmax(x)`` as ``e = exp(x - max(x)); e / sum(e)``, with the row maximum clamped
from below by ``-inf`` (``maximum(-inf, max(x))``, its ``initial``) and each reduction without
keepdims, reshaped back for the broadcast. Matched on meaning: the max and the sum reduce the
same single axis, with or without keepdims (then reshaped or expanded back, or left to
broadcast), the clamp is optional. As ``nn.softmax`` it is one row kernel, and the ``softmax``
and ``attention`` fusions see it.

Numerics: ``maximum(-inf, m)`` is ``m`` for every ``m`` but NaN, and a row holding a NaN is all
NaN either way (``x - m`` and the sum carry it), so dropping the clamp changes no result. TOPI's
softmax subtracts the same row maximum before ``exp``, so nothing else changes either. A clamp at
a finite value is declined: it shifts rows whose maximum lies below it, and a shift far enough
underflows every ``exp`` to 0 (0/0 where the softmax is finite).
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule, non_float_reason, scalar_constant, shape_dims, symbolic_dim_reason
from .layernorm_decomposed import reduction_axes
from .layernorm_one_pass import kept_shape, kept_shape_reason, restored


class SoftmaxDecomposed(RewriteRule):
    name = "softmax_decomposed"
    description = ("exp(x - [maximum(-inf,] max(x)[)]) / sum(exp(...)) over one axis, with or without keepdims, "
                   "as jax/jax2tf write softmax -> nn.softmax")
    runs_after = ("stacked_max_min",)  # the clamp arrives as ONNX Max: a stack and a max until then
    runs_before = ("softmax_flattened",)  # which reads the nn.softmax this writes
    exclusive = ("row_max", "clamped", "max_restored", "shifted", "exp", "row_sum", "sum_restored")

    def variants(self):
        x, floor = wildcard(), wildcard()
        named = {"x": x, "floor": floor}
        row_max = named["row_max"] = is_op("relax.max")(x)
        named["clamped"] = is_op("relax.maximum")(floor, row_max) | is_op("relax.maximum")(row_max, floor) | row_max
        shifted = named["shifted"] = is_op("relax.subtract")(x, restored(named["clamped"], named, "max_restored"))
        exp = named["exp"] = is_op("relax.exp")(shifted)
        row_sum = named["row_sum"] = is_op("relax.sum")(exp)
        probs = is_op("relax.divide")(exp, restored(row_sum, named, "sum_restored"))
        return [(probs, named)]

    def check(self, matched):
        x = matched["x"]
        if reason := non_float_reason(x):
            return reason
        shape = shape_dims(x)
        if not shape:
            return "the input's rank is not known"
        axes = reduction_axes(matched["row_max"], len(shape))
        if len(axes) != 1:
            return f"the maximum is over axes {axes}: a softmax reduces one axis"
        if reduction_axes(matched["row_sum"], len(shape)) != axes:
            sum_axes = reduction_axes(matched["row_sum"], len(shape))
            return f"the maximum is over axis {axes[0]}, the sum over axes {sum_axes}"
        if reason := symbolic_dim_reason("softmax input", shape, axes, role="softmax axis"):
            return reason
        if matched["clamped"].op.name == "relax.maximum":
            floor = scalar_constant(matched["floor"])
            if floor is None or not (math.isinf(floor) and floor < 0):
                shown = "a non-constant" if floor is None else floor
                return (f"the row maximum is clamped at {shown}, not -inf: that shifts rows below it "
                        "(and can underflow them)")
        kept = kept_shape(shape, axes)
        for what, name in (("restored maximum", "max_restored"), ("restored sum", "sum_restored")):
            if reason := kept_shape_reason(what, matched[name], kept):
                return reason
        return None

    def rewrite(self, matched):
        x = matched["x"]
        rank = len(shape_dims(x))
        return relax.op.nn.softmax(x, axis=reduction_axes(matched["row_max"], rank)[0] - rank)
