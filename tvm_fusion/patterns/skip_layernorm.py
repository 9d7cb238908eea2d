"""Skip LayerNorm: residual Add (+ bias Add) + LayerNorm as one row-wise kernel.

Unfused, the sum of a transformer block's output and its residual goes through memory once
more than needed: written by the add, read back by LayerNorm. Fused, each row is read once,
its mean and variance are computed while it is in cache, and it is normalized in the same
task. When a later op needs the sum itself (pre-norm blocks such as GPT-2 carry it as the
next residual), FuseOpsByPattern gives the composite a second output, as ONNX Runtime's
SkipLayerNormalization does.

This runs before ``gemm_epilogue`` in the pipeline (ONNX Runtime's order): the residual and
bias adds go with the normalization, which then reads the matmul output once instead of the
matmul epilogue writing the sum that the normalization reads back.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax
from tvm.relax.dpl import DFPattern, is_op, wildcard

from .base import (FusionRule, broadcasts_to, dims_text, dtype_of, non_float_reason, shape_dims,
                   symbolic_dim_reason)


def skip_norm_variants(norm: Callable[[DFPattern], DFPattern]):
    """``norm(x + bias + skip)`` and ``norm(x + skip)``, longest first.

    ``norm`` builds the normalization pattern around its input; the variant names say which
    adds are absorbed. Add is commutative in the matcher, so operand order does not matter.
    """
    variants = []
    for with_bias in (True, False):
        x, skip = wildcard(), wildcard()
        annotations = {"x": x, "skip": skip}
        summed = x
        if with_bias:
            annotations["bias"] = wildcard()
            summed = annotations["bias_add"] = is_op("relax.add")(x, annotations["bias"])
        annotations["sum"] = is_op("relax.add")(summed, skip)
        annotations["norm"] = norm(annotations["sum"])
        variants.append(("bias_skip" if with_bias else "skip", annotations["norm"], annotations))
    return variants


def skip_norm_check(context: relax.transform.PatternCheckContext) -> str | None:
    """Why a matched ``norm(sum of adds)`` cannot become one row-wise kernel, or None."""
    found = context.annotated_expr
    norm = found["norm"]
    if reason := non_float_reason(norm):
        return reason
    shape = shape_dims(norm)
    if not shape:
        added = ", ".join(f"{role} {dims_text(shape_dims(found[role]))}" for role in ("x", "bias", "skip")
                          if role in found)
        return f"the normalized tensor's shape is not known (the sum of {added})"
    axes = sorted(int(a) % len(shape) for a in norm.attrs.axes)
    if axes != list(range(len(shape) - len(axes), len(shape))):
        return (f"normalizes over axes {axes} of a rank-{len(shape)} tensor, not the trailing "
                "axes: a row would not be contiguous")
    # The rows (batch, sequence) may vary; the row itself is what the kernel reduces and tiles.
    if reason := symbolic_dim_reason("normalized tensor", shape, axes, role="normalized axis"):
        return reason
    for role in ("x", "bias", "skip"):
        if role not in found:
            continue
        operand_shape = shape_dims(found[role])
        if not broadcasts_to(operand_shape, shape):
            return (f"{role} shape {dims_text(operand_shape)} does not broadcast to the normalized "
                    f"shape {dims_text(shape)}")
        if dtype_of(found[role]) != dtype_of(norm):
            return f"{role} dtype {dtype_of(found[role])} differs from {dtype_of(norm)}"
    if "bias_add" in found and leaks(context, found["bias_add"]):
        return "the bias add's result is also used outside the chain"
    return None


def leaks(context: relax.transform.PatternCheckContext, expr: relax.Expr) -> bool:
    """True if the matched ``expr`` has a consumer outside the matched bindings."""
    var = context.value_to_bound_var.get(expr)
    if var is None:
        return False
    inside = set(context.matched_bindings.keys())
    return not isinstance(var, relax.DataflowVar) or any(
        user not in inside for user in context.var_usages.get(var, []))


class SkipLayerNorm(FusionRule):
    name = "skip_layernorm"
    runs_before = ("gemm_epilogue",)
    description = ("residual add (+ bias add) + layer_norm -> one row-wise kernel "
                   "(also writes the sum when a later op reads it)")

    def variants(self):
        return skip_norm_variants(
            lambda summed: is_op("relax.nn.layer_norm")(summed, wildcard(), wildcard()))

    def anchor(self, context):
        return context.annotated_expr["norm"]

    def check(self, context):
        return skip_norm_check(context)
