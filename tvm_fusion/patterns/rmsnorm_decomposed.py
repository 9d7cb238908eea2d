"""Exporter-decomposed RMSNorm (Llama, T5, SimplifiedLayerNormalization) -> ``R.nn.rms_norm``.

ONNX has no RMSNorm op below opset 23, so ``x * rsqrt(mean(x^2) + eps) * w`` arrives as
Pow 2, ReduceMean, Add eps, Sqrt, then Div(1, .) / Reciprocal and Mul, or Div(x, .). Llama
computes it in float32 on a half-precision input: Cast in, Cast back, then Mul by the weight.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, close_to, non_float_reason, scalar_constant, shape_dims
from .layernorm_decomposed import affine_param, affine_param_reason, reduced_axes, row_reason, trailing_axes_reason


class RmsNormDecomposed(RewriteRule):
    name = "rmsnorm_decomposed"
    description = ("x / sqrt(mean(x^2) + eps) (* weight), with optional float32 casts around it, "
                   "as exporters write it -> nn.rms_norm")
    exclusive = ("square", "mean_square", "mean_square_eps", "std", "inverse", "normalized",
                 "computed", "restored")

    def variants(self):
        variants = []
        for cast in (True, False):
            for weighted in (True, False):
                x, two, eps, one = wildcard(), is_const(), wildcard(), is_const()
                named = {"x": x, "two": two, "eps": eps, "one": one}
                computed = named["computed"] = is_op("relax.astype")(x) if cast else x
                named["square"] = (is_op("relax.power")(computed, two)
                                   | is_op("relax.multiply")(computed, computed))
                named["mean_square"] = is_op("relax.mean")(named["square"])
                named["mean_square_eps"] = is_op("relax.add")(named["mean_square"], eps)
                named["std"] = is_op("relax.sqrt")(named["mean_square_eps"])
                named["inverse"] = is_op("relax.divide")(one, named["std"])
                named["normalized"] = (is_op("relax.multiply")(computed, named["inverse"])
                                       | is_op("relax.divide")(computed, named["std"]))
                root = named["normalized"]
                if cast:
                    root = named["restored"] = is_op("relax.astype")(root)
                if weighted:
                    named["weight"] = wildcard()
                    root = is_op("relax.multiply")(root, named["weight"])
                variants.append((root, named))
        return variants

    def check(self, matched):
        x = matched["x"]
        if reason := non_float_reason(x):
            return reason
        if "restored" in matched:
            computed_dtype = matched["computed"].ty.dtype
            if matched["restored"].ty.dtype != x.ty.dtype:
                return (f"dtype mismatch: the input is {x.ty.dtype}, computed in {computed_dtype}, "
                        f"but cast back to {matched['restored'].ty.dtype}")
            if reason := non_float_reason(matched["computed"]):
                return reason
        shape = shape_dims(x)
        if not shape:
            return "the input's rank is not known"
        axes = reduced_axes(matched["mean_square"], len(shape))
        if reason := trailing_axes_reason(axes, len(shape), "mean-square") or row_reason(shape, axes):
            return reason
        if matched["square"].op.name == "relax.power" and not close_to(scalar_constant(matched["two"]), 2.0):
            return f"the power is {scalar_constant(matched['two'])}, not 2"
        if "inverse" in matched and not close_to(scalar_constant(matched["one"]), 1.0):
            return f"the numerator of the inverse is {scalar_constant(matched['one'])}, not 1"
        if scalar_constant(matched["eps"]) is None:
            return "epsilon is not a constant"
        return affine_param_reason("weight", matched.get("weight"), shape[axes[0]:])

    def rewrite(self, matched):
        x = matched["x"]
        computed = matched.get("computed", x)
        shape, dtype = shape_dims(x), computed.ty.dtype
        axes = reduced_axes(matched["mean_square"], len(shape))
        weight = matched.get("weight")
        if weight is not None and "restored" in matched:
            weight = relax.op.astype(weight, dtype)
        out = relax.op.nn.rms_norm(computed, affine_param(weight, shape[axes[0]:], dtype, 1.0),
                                   axes=[axis - len(shape) for axis in axes],
                                   epsilon=scalar_constant(matched["eps"]))
        return relax.op.astype(out, x.ty.dtype) if "restored" in matched else out
