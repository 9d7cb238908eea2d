"""GroupNorm as exporters write it -> ``R.nn.group_norm``.

ONNX has no GroupNormalization below opset 18 (and a per-group scale until 21), so torch's
exporter writes ``nn.GroupNorm(G, C)`` as Reshape (N, C, ... -> N, G, -1), InstanceNormalization
over the G "channels" with scale 1 and bias 0, Reshape back, Mul gamma and Add beta per
channel. TVM imports the instance norm as mean, variance, sub, add eps, sqrt, div and a
per-group multiply and add: a dozen kernels, several passes over the whole map. As one op it
legalizes to one kernel (TOPI's group_norm), as a GroupNormalization node would.

The instance norm may also arrive decomposed (ReduceMean, Sub, Pow or Mul, ReduceMean, Add eps,
Sqrt, Div over the view's last axis); this rule runs before ``layernorm_decomposed``, which would
otherwise take that chain for a layer norm of the view.
"""

from __future__ import annotations

import itertools

import numpy as np
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .base import (RewriteRule, close_to, dims_text, non_float_reason, same_dim, same_dims, scalar_constant,
                   shape_dims, symbolic_dim_reason)
from .layernorm_decomposed import affine_param, reduced_axes


def instance_norm(grouped, named: dict, decomposed: bool) -> DFPattern:
    """(view - mean) / sqrt(variance + eps) over the view's last axis, without the instance norm's
    scale and bias: as TVM's InstanceNormalization converter writes it (a variance op), or as an
    exporter decomposes it (the mean of the centered view squared, by Pow 2 or a Mul)."""
    named["mean"] = is_op("relax.mean")(grouped)
    named["centered"] = is_op("relax.subtract")(grouped, named["mean"])
    if decomposed:
        named["two"] = is_const()
        named["square"] = (is_op("relax.power")(named["centered"], named["two"])
                           | is_op("relax.multiply")(named["centered"], named["centered"]))
        named["variance"] = is_op("relax.mean")(named["square"])
    else:
        named["variance"] = is_op("relax.variance")(grouped)
    named["eps"] = is_const()
    named["variance_eps"] = is_op("relax.add")(named["variance"], named["eps"])
    named["std"] = is_op("relax.sqrt")(named["variance_eps"])
    return is_op("relax.divide")(named["centered"], named["std"])


def constant_values(expr: relax.Expr) -> np.ndarray | None:
    value = getattr(expr, "value", None)
    return value.numpy() if hasattr(value, "numpy") else None


def group_affine_reason(matched) -> str | None:
    """A group norm normalizes each group with scale 1 and bias 0 (torch's constant ones and
    zeros on the InstanceNormalization); its affine is per channel, after the reshape back."""
    for name, role, expected in (("group_scale", "scale", 1.0), ("group_shift", "bias", 0.0)):
        values = constant_values(matched[name]) if name in matched else np.full(1, expected)
        if values is None or not np.allclose(values, expected, rtol=0, atol=1e-6):
            return f"the instance norm's {role} is not {expected:g} everywhere (an affine per group, not per channel)"
    return None


def per_channel_reason(name: str, param: relax.Expr | None, shape: tuple) -> str | None:
    """gamma and beta hold one value per channel: (C, 1, ...) as torch unsqueezes them, or (1, C, 1, ...)."""
    if param is None:
        return None
    dims, channels, rank = shape_dims(param), shape[1], len(shape)
    accepted = [(channels,) + (1,) * (rank - 2), (1, channels) + (1,) * (rank - 2)]
    if dims is None or not any(same_dims(dims, ok) for ok in accepted):
        return f"{name} shape {dims_text(dims)} is not one value per channel of {dims_text(shape)}"
    return None


class GroupNorm(RewriteRule):
    name = "group_norm"
    runs_before = ("layernorm_decomposed",)
    description = ("reshape to (N, G, -1) -> instance norm (scale 1, bias 0) -> reshape back (* gamma + beta "
                   "per channel), as exporters write GroupNorm -> nn.group_norm")
    exclusive = ("mean", "centered", "square", "variance", "variance_eps", "std", "normalized", "group_scaled",
                 "group_shifted", "restored", "scaled")

    def variants(self):
        variants = []  # longest first: with the affines before without
        for decomposed, group_affine, channel_affine in itertools.product((False, True), (True, False), (True, False)):
            x = wildcard()
            named = {"x": x}
            named["grouped"] = is_op("relax.reshape")(x, wildcard())
            out = named["normalized"] = instance_norm(named["grouped"], named, decomposed)
            if group_affine:
                named["group_scale"], named["group_shift"] = is_const(), is_const()
                named["group_scaled"] = is_op("relax.multiply")(out, named["group_scale"])
                out = named["group_shifted"] = is_op("relax.add")(named["group_scaled"], named["group_shift"])
            out = named["restored"] = is_op("relax.reshape")(out, wildcard())
            if channel_affine:
                named["gamma"], named["beta"] = wildcard(), wildcard()
                named["scaled"] = is_op("relax.multiply")(out, named["gamma"])
                out = is_op("relax.add")(named["scaled"], named["beta"])
            variants.append((out, named))
        return variants

    def check(self, matched):
        x = matched["x"]
        if reason := non_float_reason(x):
            return reason
        shape, view = shape_dims(x), shape_dims(matched["grouped"])
        if shape is None or len(shape) < 3:
            return f"the input has shape {dims_text(shape)}, not (N, C, spatial...)"
        if reason := symbolic_dim_reason("input", shape, (1,), role="channels"):
            return reason
        if view is None or len(view) != 3 or not same_dim(view[0], shape[0]) or not isinstance(view[1], int):
            return f"the view {dims_text(view)} of the input {dims_text(shape)} is not (N, groups, -1)"
        if shape[1] % view[1]:
            return f"{view[1]} groups do not divide {shape[1]} channels"
        if not same_dims(shape_dims(matched["restored"]), shape):
            return (f"the normalized view is reshaped to {dims_text(shape_dims(matched['restored']))}, "
                    f"not back to the input's {dims_text(shape)}")
        if reason := self._norm_reason(matched):
            return reason
        if reason := group_affine_reason(matched):
            return reason
        return per_channel_reason("gamma", matched.get("gamma"), shape) or per_channel_reason(
            "beta", matched.get("beta"), shape)

    @staticmethod
    def _norm_reason(matched) -> str | None:
        """The norm of the view is over its last axis, each (n, group) row on its own."""
        for name in ("mean", "variance"):
            if reduced_axes(matched[name], 3) != [2]:
                return f"the {name} is not over the view's last axis with kept dims"
        square = matched.get("square")
        if square is not None and square.op.name == "relax.power" and not close_to(scalar_constant(matched["two"]), 2):
            return f"the variance power is {scalar_constant(matched['two'])}, not 2"
        if scalar_constant(matched["eps"]) is None:
            return "epsilon is not a scalar constant"
        return None

    def rewrite(self, matched):
        x = matched["x"]
        shape, dtype = shape_dims(x), x.ty.dtype
        channels, groups = shape[1], shape_dims(matched["grouped"])[1]
        epsilon = scalar_constant(matched["eps"])
        return relax.op.nn.group_norm(
            x, affine_param(matched.get("gamma"), (channels,), dtype, 1.0),
            affine_param(matched.get("beta"), (channels,), dtype, 0.0),
            num_groups=groups, channel_axis=1, axes=list(range(2, len(shape))), epsilon=epsilon)
