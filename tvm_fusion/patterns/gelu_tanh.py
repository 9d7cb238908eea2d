"""Exporter-decomposed tanh GELU (GPT-2's ``gelu_new``, FastGelu) -> ``R.nn.gelu_tanh``.

0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), with x^3 as Pow(x, 3) or x*x*x, and
the coefficient multiplied in at any point of the product (jax2tf writes ``x * (x * (c * x))``).
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_const, is_op

from .base import RewriteRule, close_to, constants_reason, non_float_reason, scalar_constant
from .gelu_erf import gelu_variants

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC_COEFFICIENT = 0.044715


def cubic_term(x, named):
    """``coefficient * x^3`` in each way exporters group the product (multiply matches either
    operand order): the cube first (as Pow or x*x*x), the coefficient first, or in between."""
    multiply, coefficient = is_op("relax.multiply"), named["coefficient"]
    cube = is_op("relax.power")(x, named["three"]) | multiply(multiply(x, x), x)
    return (multiply(cube, coefficient)
            | multiply(x, multiply(x, multiply(coefficient, x)))
            | multiply(multiply(x, x), multiply(x, coefficient))
            | multiply(multiply(multiply(x, x), coefficient), x))


class GeluTanh(RewriteRule):
    name = "gelu_tanh"
    description = "0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) -> nn.gelu_tanh"

    def variants(self):
        def tanh_of_cubic(x, named):
            named.update(three=is_const(), coefficient=is_const(), scale=is_const())
            inner = is_op("relax.add")(x, cubic_term(x, named))
            return is_op("relax.tanh")(is_op("relax.multiply")(inner, named["scale"]))

        return gelu_variants(tanh_of_cubic)

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        if "three" in matched and not close_to(scalar_constant(matched["three"]), 3.0):
            return f"the power is {scalar_constant(matched['three'])}, not 3"
        return constants_reason(matched, {
            "coefficient": (CUBIC_COEFFICIENT,
                            f"cubic coefficient {scalar_constant(matched['coefficient'])} is not {CUBIC_COEFFICIENT}"),
            "scale": (SQRT_2_OVER_PI, f"tanh scale {scalar_constant(matched['scale'])} is not sqrt(2/pi)"),
            "one": (1.0, "the constant added to tanh is not 1"),
            "half": (0.5, "the outer factor is not 0.5")})

    def rewrite(self, matched):
        return relax.op.nn.gelu_tanh(matched["x"])
