"""Exporter-decomposed tanh GELU (GPT-2's ``gelu_new``, FastGelu) -> ``R.nn.gelu_tanh``.

0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), with x^3 as Pow(x, 3) or x*x*x.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, close_to, non_float_reason, scalar_constant
from .gelu_erf import half_times_x_times

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC_COEFFICIENT = 0.044715


class GeluTanh(RewriteRule):
    name = "gelu_tanh"
    description = "0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) -> nn.gelu_tanh"

    def variants(self):
        variants = []
        for association in range(3):
            x, three, coefficient, scale, one, half = (wildcard(), is_const(), is_const(),
                                                       is_const(), is_const(), is_const())
            square = is_op("relax.multiply")(x, x)
            cube = (is_op("relax.power")(x, three)
                    | is_op("relax.multiply")(square, x))
            inner = is_op("relax.add")(x, is_op("relax.multiply")(cube, coefficient))
            tanh_plus_one = is_op("relax.add")(
                is_op("relax.tanh")(is_op("relax.multiply")(inner, scale)), one)
            root = half_times_x_times(x, tanh_plus_one, half)[association]
            variants.append((root, {"x": x, "cube": cube, "three": three, "coefficient": coefficient,
                                    "scale": scale, "one": one, "half": half}))
        return variants

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        if matched["cube"].op.name == "relax.power" and not close_to(scalar_constant(matched["three"]), 3.0):
            return f"the power is {scalar_constant(matched['three'])}, not 3"
        if not close_to(scalar_constant(matched["coefficient"]), CUBIC_COEFFICIENT):
            return f"cubic coefficient {scalar_constant(matched['coefficient'])} is not {CUBIC_COEFFICIENT}"
        if not close_to(scalar_constant(matched["scale"]), SQRT_2_OVER_PI):
            return f"tanh scale {scalar_constant(matched['scale'])} is not sqrt(2/pi)"
        if not close_to(scalar_constant(matched["one"]), 1.0):
            return "the constant added to tanh is not 1"
        if not close_to(scalar_constant(matched["half"]), 0.5):
            return "the outer factor is not 0.5"
        return None

    def rewrite(self, matched):
        return relax.op.nn.gelu_tanh(matched["x"])
