"""Exporter-decomposed HardSwish -> ``x * hardsigmoid(x)`` in the canonical HardSigmoid form.

Exporters write HardSwish as ``x * Clip(x + 3, 0, 6) / 6`` (in either association) or
``x * Clip(x + 3, 0, 6) * (1/6)``; TVM imports ONNX HardSwish as ``x * (clip(x + 3, 0, 6) / 6)``.
All become ``x * clip(x/6 + 0.5, 0, 1)`` (equal up to float rounding), so the conv epilogue
fusion needs one HardSwish pattern. Runs after ``clip`` and before ``hardsigmoid``.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule
from .hardsigmoid import canonical_hardsigmoid, check_relu6_over_6, divided_by_6, relu6_of_x_plus_3


class HardSwish(RewriteRule):
    name = "hardswish"
    runs_after = ("clip",)
    runs_before = ("hardsigmoid",)
    description = "x * Clip(x+3, 0, 6) / 6 in any association -> x * clip(x/6 + 0.5, 0, 1)"

    def variants(self):
        variants = []
        # x * (relu6(x + 3) / 6): the importer's form of ONNX HardSwish.
        x = wildcard()
        clipped, named = relu6_of_x_plus_3(x)
        gate, scale_named = divided_by_6(clipped)
        variants.append((is_op("relax.multiply")(x, gate), {"x": x, **named, **scale_named}))
        # (x * relu6(x + 3)) / 6 and (x * relu6(x + 3)) * (1/6): the exporters' forms.
        x = wildcard()
        clipped, named = relu6_of_x_plus_3(x)
        root, scale_named = divided_by_6(is_op("relax.multiply")(x, clipped))
        variants.append((root, {"x": x, **named, **scale_named}))
        return variants

    def check(self, matched):
        return check_relu6_over_6(matched)

    def rewrite(self, matched):
        x = matched["x"]
        return relax.op.multiply(x, canonical_hardsigmoid(x))
