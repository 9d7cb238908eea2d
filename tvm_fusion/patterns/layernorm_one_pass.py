"""LayerNorm with a one-pass variance, ``E[x^2] - E[x]^2`` (flax, jax2tf) -> ``R.nn.layer_norm``.

flax's ``LayerNorm`` computes the mean and the mean square of the row in one pass and takes
their difference, clamped at zero: ``var = max(0, E[x^2] - E[x]^2)``, then
``(x - mean) * (rsqrt(var + eps) * gamma) + beta``. jax2tf writes each mean as a ``Sum``
times ``1/N`` without keepdims, reshaped back for the broadcasts, and the clamp as a ``Max``
(``stacked_max_min`` turns TVM's import of it into ``maximum``). Matched on meaning, not on one
exporter's spelling: a mean is ``mean(t)``, ``sum(t) * (1/N)`` or ``sum(t) / N``, with or without
keepdims (then reshaped or expanded back, or left to broadcast); the clamp is optional; the
inverse std is ``1 / sqrt(v + eps)``, ``rsqrt(v + eps)`` or a division by ``sqrt(v + eps)``;
gamma multiplies the inverse std or the normalized row. The two-pass form (``E[(x - mean)^2]``)
is ``layernorm_decomposed``'s.

Numerics: TOPI's ``layer_norm`` computes the variance in two passes, ``sum((x - mean)^2) / N``.
In exact arithmetic that equals ``E[x^2] - E[x]^2``; in floating point it is the more accurate
of the two (the one-pass difference cancels when ``|mean|`` is large against the std, and can
even round below zero, which is all the clamp is for; a sum of squares is never negative, so
the clamp has nothing left to do). The rewrite therefore keeps the exporter's semantics but not
its rounding error: results agree to float rounding where the rows are not far off zero, and
where they are, ours are the closer to the exact value (``tests/patterns/test_layernorm_one_pass.py``
checks both against float64). A clamp at anything but zero changes results and is declined.

Only trailing axes are rewritten: our row schedules (``Reduction``, ``SkipNorm``) need the
normalized axes innermost, and a layer norm over an outer axis (magika's first, over the 512
positions of ``[1, 512, 256]``) would fall to ``Fallback`` as one scalar kernel, where its
decomposed form still gets ``Reduction`` for the two sums and ``Injective`` for the rest.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .base import RewriteRule, close_to, dims_text, non_float_reason, same_dims, scalar_constant, shape_dims
from .layernorm_decomposed import affine_param, reduction_axes, row_reason

# (gamma placement, beta): gamma into the inverse std (flax), after the normalized row (torch), or none.
AFFINE = (("inner", True), ("inner", False), ("outer", True), ("outer", False), (None, True), (None, False))


def mean_pattern(operand: DFPattern, named: dict, name: str) -> DFPattern:
    """``mean(operand) | sum(operand) * c | sum(operand) / c``, named ``name`` (the sum and its
    scale ``{name}_sum`` / ``{name}_scale``: ``mean_scale_reason`` checks ``c`` is 1/N or N)."""
    total, scale = is_op("relax.sum")(operand), is_const()
    named[f"{name}_sum"], named[f"{name}_scale"] = total, scale
    named[name] = (is_op("relax.mean")(operand) | is_op("relax.multiply")(total, scale)
                   | is_op("relax.divide")(total, scale))
    return named[name]


def restored(reduced: DFPattern, named: dict, name: str) -> DFPattern:
    """``reduced``, or ``reduced`` reshaped / expanded back to the input's rank (a reduction
    without keepdims), named ``name``; ``kept_shape_reason`` checks it broadcasts as keepdims."""
    named[name] = is_op("relax.reshape")(reduced, wildcard()) | is_op("relax.expand_dims")(reduced) | reduced
    return named[name]


def reduction_of(matched, name: str) -> relax.Call:
    """The reducing call of a ``mean_pattern`` match: the ``mean``, or the ``sum`` it scales."""
    mean = matched[name]
    return mean if mean.op.name == "relax.mean" else matched[f"{name}_sum"]


def mean_scale_reason(matched, name: str, shape: tuple, axes: list[int]) -> str | None:
    """Why a ``sum * c`` / ``sum / c`` mean does not divide by the number of reduced elements."""
    mean = matched[name]
    if mean.op.name == "relax.mean":
        return None
    count = math.prod(shape[axis] for axis in axes)
    scale = scalar_constant(matched[f"{name}_scale"])
    expected = 1.0 / count if mean.op.name == "relax.multiply" else float(count)
    if scale is None or abs(scale / expected - 1.0) > 1e-6:
        spelled = "1/N" if mean.op.name == "relax.multiply" else "N"
        return f"the {name} scales its sum by {scale}, not {spelled} = {expected:g} (N = {count} reduced elements)"
    return None


def kept_shape(shape: tuple, axes: list[int]) -> tuple:
    """``shape`` with the reduced ``axes`` kept as 1s (a keepdims reduction's shape)."""
    return tuple(1 if axis in axes else dim for axis, dim in enumerate(shape))


def kept_shape_reason(what: str, expr: relax.Expr, kept: tuple) -> str | None:
    """Why ``expr`` does not broadcast against the input as the keepdims reduction would: its
    shape, padded with leading 1s to the input's rank, must be ``kept``."""
    dims = shape_dims(expr)
    if dims is None or len(dims) > len(kept) or not same_dims((1,) * (len(kept) - len(dims)) + dims, kept):
        return f"the {what} has the shape {dims_text(dims)}, which does not broadcast as {dims_text(kept)}"
    return None


def per_axis_param_reason(name: str, param: relax.Expr | None, shape: tuple, axes: list[int]) -> str | None:
    """A gamma/beta must vary along the normalized axes only: padded to the input's rank, its
    dims are the input's at ``axes`` and 1 elsewhere."""
    if param is None:
        return None
    dims = shape_dims(param)
    expected = tuple(dim if axis in axes else 1 for axis, dim in enumerate(shape))
    if dims is None or len(dims) > len(shape) or not same_dims((1,) * (len(shape) - len(dims)) + dims, expected):
        return f"{name} shape {dims_text(dims)} does not hold one value per position of the normalized axes"
    return None


class LayerNormOnePass(RewriteRule):
    name = "layernorm_one_pass"
    description = ("mean and mean square -> max(0, E[x^2] - E[x]^2) -> 1/sqrt(+ eps) (* gamma + beta), "
                   "as flax/jax2tf write LayerNorm -> nn.layer_norm")
    runs_after = ("stacked_max_min",)  # the clamp arrives as ONNX Max: a stack and a max until then
    exclusive = ("mean", "mean_sum", "square", "mean_square", "mean_square_sum", "mean_squared", "variance",
                 "clamped", "variance_restored", "variance_eps", "std", "inverse", "mean_restored", "centered",
                 "scale", "normalized", "scaled")

    def variants(self):
        return [self._variant(gamma, beta) for gamma, beta in AFFINE]

    @staticmethod
    def _variant(gamma: str | None, beta: bool):
        x, two, two_mean, zero, eps, one = wildcard(), is_const(), is_const(), wildcard(), wildcard(), is_const()
        named = {"x": x, "two": two, "two_mean": two_mean, "zero": zero, "eps": eps, "one": one}
        mean = mean_pattern(x, named, "mean")
        named["square"] = is_op("relax.multiply")(x, x) | is_op("relax.power")(x, two)
        mean_square = mean_pattern(named["square"], named, "mean_square")
        named["mean_squared"] = is_op("relax.multiply")(mean, mean) | is_op("relax.power")(mean, two_mean)
        variance = named["variance"] = is_op("relax.subtract")(mean_square, named["mean_squared"])
        named["clamped"] = is_op("relax.maximum")(zero, variance) | is_op("relax.maximum")(variance, zero) | variance
        variance_eps = named["variance_eps"] = is_op("relax.add")(
            restored(named["clamped"], named, "variance_restored"), eps)
        std = named["std"] = is_op("relax.sqrt")(variance_eps)
        inverse = named["inverse"] = is_op("relax.divide")(one, std) | is_op("relax.rsqrt")(variance_eps)
        centered = named["centered"] = is_op("relax.subtract")(x, restored(mean, named, "mean_restored"))
        if gamma == "inner":
            named["gamma"] = wildcard()
            named["scale"] = is_op("relax.multiply")(inverse, named["gamma"])
            root = named["normalized"] = is_op("relax.multiply")(centered, named["scale"])
        else:
            root = named["normalized"] = (is_op("relax.multiply")(centered, inverse)
                                          | is_op("relax.divide")(centered, std))
        if gamma == "outer":
            named["gamma"] = wildcard()
            root = named["scaled"] = is_op("relax.multiply")(root, named["gamma"])
        if beta:
            named["beta"] = wildcard()
            root = is_op("relax.add")(root, named["beta"])
        return root, named

    def check(self, matched):
        x = matched["x"]
        if reason := non_float_reason(x):
            return reason
        shape = shape_dims(x)
        if not shape:
            return "the input's rank is not known"
        axes = reduction_axes(reduction_of(matched, "mean"), len(shape))
        if reduction_axes(reduction_of(matched, "mean_square"), len(shape)) != axes:
            return "the mean and the mean square reduce different axes"
        if axes != list(range(axes[0], len(shape))):
            return (f"the norm is over axes {axes} of a rank-{len(shape)} tensor, not the trailing axes: "
                    "our row schedules need the normalized axes innermost")
        if reason := row_reason(shape, axes):
            return reason
        if reason := mean_scale_reason(matched, "mean", shape, axes) or mean_scale_reason(
                matched, "mean_square", shape, axes):
            return reason
        if not same_dims(shape_dims(matched["mean"]), shape_dims(matched["mean_square"])):
            return "the mean and the mean square differ in shape (keepdims)"
        for power, what in (("square", "two"), ("mean_squared", "two_mean")):
            if matched[power].op.name == "relax.power" and not close_to(scalar_constant(matched[what]), 2.0):
                return f"the {power} is a power {scalar_constant(matched[what])}, not 2"
        if matched["clamped"].op.name == "relax.maximum" and scalar_constant(matched["zero"]) != 0.0:
            clamp = scalar_constant(matched["zero"])
            return (f"the variance is clamped at {'a non-constant' if clamp is None else clamp}, not 0: "
                    "that changes the result, not only its rounding")
        kept = kept_shape(shape, axes)
        if reason := kept_shape_reason("restored mean", matched["mean_restored"], kept) or kept_shape_reason(
                "restored variance", matched["variance_restored"], kept):
            return reason
        if scalar_constant(matched["eps"]) is None:
            return "epsilon is not a one-value constant"
        if "one" in matched and not close_to(scalar_constant(matched["one"]), 1.0):
            return f"the numerator of the inverse std is {scalar_constant(matched['one'])}, not 1"
        for name in ("gamma", "beta"):
            if reason := per_axis_param_reason(name, matched.get(name), shape, axes):
                return reason
        return None

    def rewrite(self, matched):
        x = matched["x"]
        shape, dtype = shape_dims(x), x.ty.dtype
        axes = reduction_axes(reduction_of(matched, "mean"), len(shape))
        row_shape = tuple(shape[axis] for axis in axes)
        return relax.op.nn.layer_norm(
            x, affine_param(matched.get("gamma"), row_shape, dtype, 1.0),
            affine_param(matched.get("beta"), row_shape, dtype, 0.0),
            axes=[axis - len(shape) for axis in axes], epsilon=scalar_constant(matched["eps"]))
