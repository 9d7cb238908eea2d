"""Exporter-decomposed HardSigmoid -> the form TVM's importer gives ONNX HardSigmoid.

Exporters without a HardSigmoid op (PyTorch below opset 14, paddle2onnx, tf2onnx) write
``Clip(x + 3, 0, 6) / 6`` or ``Clip(x + 3, 0, 6) * (1/6)``; TVM imports ONNX HardSigmoid as
``clip(alpha * x + beta, 0, 1)``. Relax has no hardsigmoid op, so that importer form is the
canonical one: every spelling ends up as it, and the conv epilogue fusion matches one shape.
Runs after ``clip`` (which turns the importer's Clip kernels into ``R.clip``).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import FLOAT_DTYPES, RewriteRule, close_to, dtype_of, scalar_constant



def prim_value(expr: relax.Expr) -> float | None:
    """The number a clip bound holds (an IntImm/FloatImm, or one wrapped in a PrimValue), or None."""
    value = getattr(expr, "value", None)
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) else None


def relu6_of_x_plus_3(x):
    """``clip(x + 3, lo, hi)`` and the names its check reads."""
    three, lo, hi = is_const(), wildcard(), wildcard()
    clipped = is_op("relax.clip")(is_op("relax.add")(x, three), lo, hi)
    return clipped, {"three": three, "lo": lo, "hi": hi}


def divided_by_6(inner):
    """``inner / 6`` or ``inner * (1/6)`` (multiply matches either operand order)."""
    scale = is_const()
    scaled = is_op("relax.divide")(inner, scale) | is_op("relax.multiply")(inner, scale)
    return scaled, {"scale": scale, "scaled": scaled}


def check_relu6_over_6(matched) -> str | None:
    """The reason ``clip(x + three, lo, hi) (/ or *) scale`` is not ``relu6(x + 3) / 6``, or None."""
    if dtype_of(matched["x"]) not in FLOAT_DTYPES:
        return f"dtype {dtype_of(matched['x'])} is not a float type"
    if not close_to(scalar_constant(matched["three"]), 3.0):
        return f"the shift added before the clip is {scalar_constant(matched['three'])}, not 3"
    lo, hi = prim_value(matched["lo"]), prim_value(matched["hi"])
    if lo != 0.0 or hi != 6.0:
        return f"clip bounds ({lo}, {hi}) are not (0, 6)"
    divides = matched["scaled"].op.name == "relax.divide"
    expected = 6.0 if divides else 1.0 / 6.0
    if not close_to(scalar_constant(matched["scale"]), expected):
        op = "divisor" if divides else "multiplier"
        return f"the {op} {scalar_constant(matched['scale'])} is not {expected:.6f}"
    return None


def canonical_hardsigmoid(x: relax.Expr, alpha: float = 1.0 / 6.0, beta: float = 0.5) -> relax.Expr:
    """``clip(alpha * x + beta, 0, 1)``, exactly as TVM imports ONNX HardSigmoid."""
    dtype = str(dtype_of(x))
    scaled = relax.op.multiply(relax.const(alpha, dtype), x)
    return relax.op.clip(relax.op.add(scaled, relax.const(beta, dtype)), 0, 1)


class HardSigmoid(RewriteRule):
    name = "hardsigmoid"
    runs_after = ("clip",)
    description = "Clip(x+3, 0, 6)/6 (or *1/6) -> clip(x/6 + 0.5, 0, 1), the importer's HardSigmoid"

    def variants(self):
        x = wildcard()
        clipped, named = relu6_of_x_plus_3(x)
        root, scale_named = divided_by_6(clipped)
        return [(root, {"x": x, **named, **scale_named})]

    def check(self, matched):
        return check_relu6_over_6(matched)

    def rewrite(self, matched):
        return canonical_hardsigmoid(matched["x"])
