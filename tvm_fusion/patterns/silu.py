"""Exporter-decomposed SiLU/Swish ``x * Sigmoid(x)`` -> ``R.nn.silu``."""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import RewriteRule, non_float_reason


class Silu(RewriteRule):
    name = "silu"
    description = "x * sigmoid(x) -> nn.silu"

    def variants(self):
        x = wildcard()
        return [(is_op("relax.multiply")(x, is_op("relax.sigmoid")(x)), {"x": x})]

    def check(self, matched):
        return non_float_reason(matched["x"])

    def rewrite(self, matched):
        return relax.op.nn.silu(matched["x"])
