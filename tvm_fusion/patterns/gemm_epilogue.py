"""GEMM epilogue: MatMul/Gemm + bias + activation + residual Add as one kernel.

Each step after the matmul is elementwise, so unfused it is a full memory round trip of the
output; fused, the epilogue runs on the output tile while it is still in registers/cache.
Variants are generated from three choices (bias, activation, residual), longest first so the
biggest chain that passes the check wins.
"""

from __future__ import annotations

import itertools

from tvm.relax.dpl import is_op, wildcard

from .activations import ACTIVATIONS
from .base import (FLOAT_DTYPES, FusionRule, dims_text, dtype_of, residual_or_leak_reason, same_dim, shape_dims,
                   symbolic_dim_reason)


def gemm_epilogue_pattern(bias: bool, activation: str | None, residual: bool):
    """The pattern ``[residual +] act(matmul(lhs, rhs) [+ bias])`` and its annotations."""
    lhs, rhs = wildcard(), wildcard()
    matmul = is_op("relax.matmul")(lhs, rhs)
    annotations = {"lhs": lhs, "rhs": rhs, "matmul": matmul}
    out = matmul
    if bias:
        annotations["bias"] = wildcard()
        out = annotations["bias_add"] = is_op("relax.add")(out, annotations["bias"])
    if activation:
        out = annotations["activation"] = ACTIVATIONS[activation](out)
    if residual:
        annotations["residual"] = wildcard()
        out = annotations["residual_add"] = is_op("relax.add")(out, annotations["residual"])
    return out, annotations


def variant_name(bias: bool, activation: str | None, residual: bool) -> str:
    return "_".join(["matmul"] + (["bias"] if bias else []) + ([activation] if activation else [])
                    + (["residual"] if residual else []))


class GemmEpilogue(FusionRule):
    name = "gemm_epilogue"
    absorbs_elementwise_tail = True
    description = ("matmul + bias + activation (relu, gelu, gelu_tanh, sigmoid, silu, clip, leakyrelu, "
                   "prelu, hardsigmoid, hardswish) + residual add")

    def variants(self):
        choices = itertools.product((True, False), (*ACTIVATIONS, None), (True, False))
        variants = [(variant_name(*choice), *gemm_epilogue_pattern(*choice))
                    for choice in choices if any(choice)]
        # Longest chain first; at equal length try bias before residual (a vector operand is a bias).
        return sorted(variants, key=lambda v: -len(v[0].split("_")))

    def anchor(self, context):
        return context.annotated_expr["matmul"]

    def check(self, context):
        found = context.annotated_expr
        dtype = dtype_of(found["matmul"])
        if dtype not in FLOAT_DTYPES:
            return f"dtype {dtype} is not supported ({', '.join(FLOAT_DTYPES)})"
        out_shape, lhs_shape = shape_dims(found["matmul"]), shape_dims(found["lhs"])
        if not out_shape or not lhs_shape:
            return "the matmul operands' ranks are not known"
        # Rows and batch may vary (one kernel for a range of sequence lengths); the column tile
        # and the unrolled reduction are built around N and K.
        reason = (symbolic_dim_reason("matmul output", out_shape, [-1], role="N")
                  or symbolic_dim_reason("matmul input", lhs_shape, [-1], role="K"))
        if reason:
            return reason
        if "bias" in found:
            bias_shape = shape_dims(found["bias"])
            if (not bias_shape or len(bias_shape) > len(out_shape) or not same_dim(bias_shape[-1], out_shape[-1])
                    or not all(same_dim(d, 1) for d in bias_shape[:-1])):
                return (f"bias shape {dims_text(bias_shape)} is not a vector along the output's last axis "
                        f"(output {dims_text(out_shape)})")
        return residual_or_leak_reason(context, dtype)
