"""Exporter-decomposed erf GELU -> ``R.nn.gelu``.

PyTorch exports ``F.gelu(x)`` as ``Mul(Mul(x, Add(Erf(Div(x, 1.4142)), 1)), 0.5)``; other
exporters put the 0.5 first or multiply by 1/sqrt(2). One op instead of five lets the GEMM
epilogue fusion see a plain activation after the bias add.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .base import RewriteRule, close_to, constants_reason, non_float_reason, scalar_constant


def half_times_x_times(x, factor, half):
    """The three ways exporters associate 0.5 * x * factor (multiply matches either order)."""
    return [
        is_op("relax.multiply")(is_op("relax.multiply")(x, factor), half),
        is_op("relax.multiply")(is_op("relax.multiply")(x, half), factor),
        is_op("relax.multiply")(x, is_op("relax.multiply")(factor, half)),
    ]


def gelu_variants(one_plus: Callable[[DFPattern, dict], DFPattern]) -> list[tuple[DFPattern, dict]]:
    """``0.5 * x * one_plus(x)`` in each association; ``one_plus`` builds ``1 + erf/tanh(...)`` of
    ``x`` and names its parts (``x``, ``one`` and ``half`` are named here)."""
    variants = []
    for association in range(3):
        named = {"x": wildcard(), "one": is_const(), "half": is_const()}
        factor = is_op("relax.add")(one_plus(named["x"], named), named["one"])
        variants.append((half_times_x_times(named["x"], factor, named["half"])[association], named))
    return variants


class GeluErf(RewriteRule):
    name = "gelu_erf"
    description = "x*0.5*(1+erf(x/sqrt(2))) in any exporter operand order -> nn.gelu"

    def variants(self):
        def erf_of_scaled(x, named):
            scale = named["scale"] = is_const()
            named["scaled"] = is_op("relax.divide")(x, scale) | is_op("relax.multiply")(x, scale)
            return is_op("relax.erf")(named["scaled"])

        return gelu_variants(erf_of_scaled)

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        scale = scalar_constant(matched["scale"])
        divides = matched["scaled"].op.name == "relax.divide"
        expected = math.sqrt(2.0) if divides else 1.0 / math.sqrt(2.0)
        if not close_to(scale, expected):
            op = "divisor" if divides else "multiplier"
            return f"erf argument {op} {scale} is not {expected:.6f}"
        return constants_reason(matched, {"one": (1.0, "the constant added to erf is not 1"),
                                          "half": (0.5, "the outer factor is not 0.5")})

    def rewrite(self, matched):
        return relax.op.nn.gelu(matched["x"])
