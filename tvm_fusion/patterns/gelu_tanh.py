"""Exporter-decomposed tanh GELU (GPT-2's ``gelu_new``, FastGelu) -> ``R.nn.gelu_tanh``.

0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), with x^3 as Pow(x, 3) or x*x*x.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import is_const, is_op

from .base import RewriteRule, close_to, constants_reason, non_float_reason, scalar_constant
from .gelu_erf import gelu_variants

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC_COEFFICIENT = 0.044715


class GeluTanh(RewriteRule):
    name = "gelu_tanh"
    description = "0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) -> nn.gelu_tanh"

    def variants(self):
        def tanh_of_cubic(x, named):
            named.update(three=is_const(), coefficient=is_const(), scale=is_const())
            named["cube"] = is_op("relax.power")(x, named["three"]) | is_op("relax.multiply")(is_op("relax.multiply")(x, x), x)
            inner = is_op("relax.add")(x, is_op("relax.multiply")(named["cube"], named["coefficient"]))
            return is_op("relax.tanh")(is_op("relax.multiply")(inner, named["scale"]))

        return gelu_variants(tanh_of_cubic)

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        if matched["cube"].op.name == "relax.power" and not close_to(scalar_constant(matched["three"]), 3.0):
            return f"the power is {scalar_constant(matched['three'])}, not 3"
        return constants_reason(matched, {
            "coefficient": (CUBIC_COEFFICIENT,
                            f"cubic coefficient {scalar_constant(matched['coefficient'])} is not {CUBIC_COEFFICIENT}"),
            "scale": (SQRT_2_OVER_PI, f"tanh scale {scalar_constant(matched['scale'])} is not sqrt(2/pi)"),
            "one": (1.0, "the constant added to tanh is not 1"),
            "half": (0.5, "the outer factor is not 0.5")})

    def rewrite(self, matched):
        return relax.op.nn.gelu_tanh(matched["x"])
