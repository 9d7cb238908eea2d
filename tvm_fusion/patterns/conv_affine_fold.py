"""A per-channel scale (and shift) after a Conv, folded into the conv's weights and bias.

Exporters write a BatchNormalization out as ``conv(x, W) * s + o`` with constant per-channel
``s`` and ``o`` (captcha CRNN's bias-less convs).
That equals ``conv(x, W * s) + (b * s + o)``: the Mul and Add disappear, and the conv keeps a
plain bias add the conv epilogue picks up with the activation after it. Constants are folded
at compile time in float64 and rounded once, as in ``conv_bn_fold``.
"""

from __future__ import annotations

import itertools

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, dtype_of, non_float_reason, whole_numbers


def _per_channel(value: np.ndarray, channels: int) -> np.ndarray | None:
    """``value`` as one number per output channel, if it broadcasts that way over NCHW."""
    if value.size == 1:
        return np.full(channels, float(value.reshape(())))
    if value.size == channels and value.shape in ((channels, 1, 1), (1, channels, 1, 1)):
        return value.reshape(-1)
    return None


def _with_constant(named: dict, op: str, value, role: str):
    """``op(value, c)`` for a new constant ``c`` named ``role``."""
    named[role] = is_const()
    return is_op(op)(value, named[role])


class ConvAffineFold(RewriteRule):
    name = "conv_affine_fold"
    runs_after = ("conv_bn_fold",)
    description = "Conv [+ bias] * per-channel scale [+ per-channel shift] -> the conv with folded weights + bias"
    exclusive = ("conv", "biased")

    def variants(self):
        variants = []
        for with_bias, with_shift in itertools.product((True, False), (True, False)):
            x, weight = wildcard(), is_const()
            named = {"x": x, "weight": weight}
            out = named["conv"] = is_op("relax.nn.conv2d")(x, weight)
            if with_bias:
                out = named["biased"] = _with_constant(named, "relax.add", out, "bias")
            out = named["scaled"] = _with_constant(named, "relax.multiply", out, "scale")
            if with_shift:
                out = _with_constant(named, "relax.add", out, "shift")
            variants.append((out, named))
        return variants

    def check(self, matched):
        conv = matched["conv"].attrs
        if reason := non_float_reason(matched["conv"]):
            return reason
        dtype = dtype_of(matched["conv"])
        if (conv.data_layout, conv.kernel_layout, conv.out_layout) != ("NCHW", "OIHW", "NCHW"):
            return f"conv layout {conv.data_layout}/{conv.kernel_layout} is not NCHW/OIHW"
        if conv.out_dtype and str(conv.out_dtype) not in ("", dtype):
            return f"the conv accumulates into {conv.out_dtype}"
        weight = matched["weight"].value.numpy()
        if whole_numbers(weight):
            # A quantized conv (frontend/qoperator.py) sums whole numbers exactly, and its scale
            # is a requantization rounded right after: folded into the weights, the products
            # would round and the rounded value could move by a step.
            return "the weights are whole numbers (a quantized conv's exact sum, then requantized)"
        channels = weight.shape[0]
        if matched["scale"].value.numpy().size == 1:
            # One number for every channel is an activation's slope as often as a scale (the
            # HardSigmoid gate's x/6 + 0.5): left to the element-wise epilogue, which takes both.
            return "the scale is one scalar, not one value per channel"
        for role in ("bias", "scale", "shift"):
            if role in matched and _per_channel(matched[role].value.numpy(), channels) is None:
                return f"the {role} has shape {matched[role].value.numpy().shape}, not one value per channel"
        return None

    def rewrite(self, matched):
        dtype = str(dtype_of(matched["conv"]))
        weight = matched["weight"].value.numpy().astype(np.float64)
        channels = weight.shape[0]
        folded = {role: _per_channel(matched[role].value.numpy().astype(np.float64), channels)
                  if role in matched else None for role in ("bias", "scale", "shift")}
        scale = folded["scale"]
        bias = (folded["bias"] if folded["bias"] is not None else 0.0) * scale
        bias = bias + (folded["shift"] if folded["shift"] is not None else 0.0)
        conv = matched["conv"].attrs
        new_conv = relax.op.nn.conv2d(
            matched["x"], relax.const((weight * scale.reshape(-1, 1, 1, 1)).astype(dtype)),
            strides=conv.strides, padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
            data_layout="NCHW", kernel_layout="OIHW", out_layout="NCHW", out_dtype=conv.out_dtype)
        return relax.op.add(new_conv, relax.const(np.broadcast_to(bias, channels).reshape(1, -1, 1, 1).astype(dtype)))
