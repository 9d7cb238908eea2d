"""Exporter-decomposed erf GELU -> ``R.nn.gelu``.

PyTorch exports ``F.gelu(x)`` as ``Mul(Mul(x, Add(Erf(Div(x, 1.4142)), 1)), 0.5)``; other
exporters put the 0.5 first or multiply by 1/sqrt(2). One op instead of five lets the GEMM
epilogue fusion see a plain activation after the bias add.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, close_to, non_float_reason, scalar_constant


def half_times_x_times(x, factor, half):
    """The three ways exporters associate 0.5 * x * factor (multiply matches either order)."""
    return [
        is_op("relax.multiply")(is_op("relax.multiply")(x, factor), half),
        is_op("relax.multiply")(is_op("relax.multiply")(x, half), factor),
        is_op("relax.multiply")(x, is_op("relax.multiply")(factor, half)),
    ]


class GeluErf(RewriteRule):
    name = "gelu_erf"
    description = "x*0.5*(1+erf(x/sqrt(2))) in any exporter operand order -> nn.gelu"

    def variants(self):
        variants = []
        for association in range(3):
            x, scale, one, half = wildcard(), is_const(), is_const(), is_const()
            scaled = is_op("relax.divide")(x, scale) | is_op("relax.multiply")(x, scale)
            erf_plus_one = is_op("relax.add")(is_op("relax.erf")(scaled), one)
            root = half_times_x_times(x, erf_plus_one, half)[association]
            variants.append((root, {"x": x, "scaled": scaled, "scale": scale, "one": one, "half": half}))
        return variants

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        scale = scalar_constant(matched["scale"])
        divides = matched["scaled"].op.name == "relax.divide"
        expected = math.sqrt(2.0) if divides else 1.0 / math.sqrt(2.0)
        if not close_to(scale, expected):
            op = "divisor" if divides else "multiplier"
            return f"erf argument {op} {scale} is not {expected:.6f}"
        if not close_to(scalar_constant(matched["one"]), 1.0):
            return "the constant added to erf is not 1"
        if not close_to(scalar_constant(matched["half"]), 0.5):
            return "the outer factor is not 0.5"
        return None

    def rewrite(self, matched):
        return relax.op.nn.gelu(matched["x"])
