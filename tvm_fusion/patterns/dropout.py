"""Inference Dropout -> its input.

At inference Dropout is the identity, but TVM imports it as ``R.nn.dropout`` and legalizes
that to a copy kernel (plus a mask of ones). Removing it saves the copy and lets the ops on
either side meet: ``gelu(matmul + bias)`` then a Dropout then a residual add becomes one GEMM
epilogue. Training-mode Dropout never reaches this form (the frontend emits the
``dropout_training`` kernel instead).
"""

from __future__ import annotations

from tvm.relax.dpl import is_op, is_tuple_get_item, wildcard

from .base import RewriteRule


class Dropout(RewriteRule):
    name = "dropout"
    description = "inference Dropout (nn.dropout(x)[0]) -> x"

    def variants(self):
        x = wildcard()
        dropout = is_op("relax.nn.dropout")(x)
        return [(is_tuple_get_item(dropout, 0), {"x": x, "dropout": dropout})]

    def check(self, matched):
        rate = float(matched["dropout"].attrs.rate)
        if not 0.0 <= rate < 1.0:
            return f"dropout ratio {rate:g} is outside [0, 1) (ONNX Runtime rejects the model)"
        return None

    def rewrite(self, matched):
        return matched["x"]
