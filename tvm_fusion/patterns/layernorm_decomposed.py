"""Exporter-decomposed LayerNorm -> ``R.nn.layer_norm``.

Below opset 17 there is no LayerNormalization op, and PyTorch writes ``nn.LayerNorm`` as
ReduceMean, Sub, Pow 2, ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta. As one op it
becomes one row-wise kernel, and ``skip_layernorm`` sees the residual add in front of it.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import (RewriteRule, close_to, dims_text, non_float_reason, same_dim, same_dims, scalar_constant,
                   shape_dims, symbolic_dim_reason)

AFFINE = ("gamma_beta", "gamma", "none")


def reduction_axes(call: relax.Call, rank: int) -> list[int]:
    """The axes a ``sum``/``mean``/``max`` reduces, non-negative and sorted (all of them when unset)."""
    axes = call.attrs.axis
    return list(range(rank)) if axes is None else sorted(int(axis) % rank for axis in axes)


def reduced_axes(mean: relax.Call, rank: int) -> list[int] | None:
    """The axes a ``keepdims`` mean reduces, normalized to non-negative, or None without keepdims."""
    if not mean.attrs.keepdims or mean.attrs.axis is None:
        return None
    return reduction_axes(mean, rank)


def trailing_axes_reason(axes: list[int] | None, rank: int, what: str) -> str | None:
    if axes is None:
        return f"the {what} mean does not keep the reduced dims"
    if not axes or axes != list(range(rank - len(axes), rank)):
        return f"the {what} mean is over axes {axes} of a rank-{rank} tensor, not the trailing axes"
    return None


def affine_param_reason(name: str, param: relax.Expr | None, row_shape: tuple[int, ...]) -> str | None:
    """A gamma/beta must broadcast along the normalized axes only: shape [1.., *row_shape]."""
    if param is None:
        return None
    shape = shape_dims(param)
    if shape is None or len(shape) < len(row_shape) \
            or not all(same_dim(d, 1) for d in shape[: len(shape) - len(row_shape)]) \
            or not same_dims(shape[len(shape) - len(row_shape):], row_shape):
        return f"{name} shape {dims_text(shape)} is not the normalized shape {row_shape}"
    return None


def affine_param(param: relax.Expr | None, row_shape: tuple[int, ...], dtype: str, fill: float) -> relax.Expr:
    """``param`` viewed with the normalized shape, or a constant ``fill`` when there is none."""
    if param is None:
        return relax.const(np.full(row_shape, fill, dtype=str(dtype)))
    if not same_dims(shape_dims(param), row_shape):
        return relax.op.reshape(param, row_shape)
    return param


def row_reason(shape: tuple, axes: list[int]) -> str | None:
    """The normalized row (the reduced trailing axes) must be static: the rewritten op's
    gamma/beta have its shape and the row-wise kernel tiles it. The leading dims may be symbolic."""
    return symbolic_dim_reason("input", shape, axes, role="normalized axis")


class LayerNormDecomposed(RewriteRule):
    name = "layernorm_decomposed"
    description = ("mean/sub/pow/mean/add eps/sqrt/div (* gamma + beta), as exporters write it "
                   "below opset 17 -> nn.layer_norm")
    exclusive = ("mean", "centered", "square", "variance", "variance_eps", "std", "normalized", "scaled")

    def variants(self):
        variants = []
        for affine in AFFINE:
            x, two, eps = wildcard(), is_const(), wildcard()
            mean = is_op("relax.mean")(x)
            centered = is_op("relax.subtract")(x, mean)
            square = is_op("relax.power")(centered, two) | is_op("relax.multiply")(centered, centered)
            variance = is_op("relax.mean")(square)
            variance_eps = is_op("relax.add")(variance, eps)
            std = is_op("relax.sqrt")(variance_eps)
            normalized = is_op("relax.divide")(centered, std)
            named = {"x": x, "two": two, "eps": eps, "mean": mean, "centered": centered,
                     "square": square, "variance": variance, "variance_eps": variance_eps,
                     "std": std, "normalized": normalized}
            root = normalized
            if affine != "none":
                named["gamma"] = wildcard()
                root = named["scaled"] = is_op("relax.multiply")(normalized, named["gamma"])
            if affine == "gamma_beta":
                named["beta"] = wildcard()
                root = is_op("relax.add")(root, named["beta"])
            variants.append((root, named))
        return variants

    def check(self, matched):
        if reason := non_float_reason(matched["x"]):
            return reason
        shape = shape_dims(matched["x"])
        if not shape:
            return "the input's rank is not known"
        axes = reduced_axes(matched["mean"], len(shape))
        if reason := trailing_axes_reason(axes, len(shape), "first") or row_reason(shape, axes):
            return reason
        if reduced_axes(matched["variance"], len(shape)) != axes:
            return "the two means reduce different axes"
        if matched["square"].op.name == "relax.power" and not close_to(scalar_constant(matched["two"]), 2.0):
            return f"the variance power is {scalar_constant(matched['two'])}, not 2"
        if scalar_constant(matched["eps"]) is None:
            return "epsilon is not a constant"
        row_shape = shape[axes[0]:]
        for name in ("gamma", "beta"):
            if reason := affine_param_reason(name, matched.get(name), row_shape):
                return reason
        return None

    def rewrite(self, matched):
        x = matched["x"]
        shape, dtype = shape_dims(x), x.ty.dtype
        axes = reduced_axes(matched["mean"], len(shape))
        row_shape = shape[axes[0]:]
        return relax.op.nn.layer_norm(
            x, affine_param(matched.get("gamma"), row_shape, dtype, 1.0),
            affine_param(matched.get("beta"), row_shape, dtype, 0.0),
            axes=[axis - len(shape) for axis in axes], epsilon=scalar_constant(matched["eps"]))
