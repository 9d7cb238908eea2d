"""Inference BatchNormalization after a Conv, folded into the conv's weights and bias.

In eval mode BN is a per-channel affine map ``y = (z - mean) * gamma / sqrt(var + eps) + beta``.
Applied to ``z = conv(x, W) [+ b]`` it equals ``conv(x, W * s) + (b - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``: the BN kernel disappears and the conv keeps a plain bias add
that the conv epilogue fusion picks up. A ConvTranspose folds the same way; its IOHW weight
holds output channel ``group * (O / groups) + o`` at ``[i, o]`` for input channel ``i`` of that
group, so the scale is gathered per (input group, o). The new constants are computed here, at
compile time, in float64 and rounded once, so the result matches the unfolded graph up to float
rounding.
"""

from __future__ import annotations

import itertools

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, wildcard

from .base import FLOAT_DTYPES, RewriteRule, dtype_of


def _constant(expr: relax.Expr) -> np.ndarray:
    return expr.value.numpy()


def _is_transpose(matched) -> bool:
    return matched["conv"].op.name == "relax.nn.conv2d_transpose"


def _output_channels(matched) -> int:
    """OIHW holds the output channels on axis 0; IOHW holds ``O / groups`` of them on axis 1."""
    shape = _constant(matched["weight"]).shape
    if _is_transpose(matched):
        return shape[1] * int(matched["conv"].attrs.groups)
    return shape[0]


def _transpose_weight_scale(scale: np.ndarray, weight_shape, groups: int) -> np.ndarray:
    """The BN scale laid out like an IOHW weight: ``[i, o]`` scales output channel
    ``(i // (I / groups)) * (O / groups) + o``."""
    inputs, outputs_per_group = weight_shape[0], weight_shape[1]
    group_of_input = np.arange(inputs) // (inputs // groups)
    channel = group_of_input[:, None] * outputs_per_group + np.arange(outputs_per_group)[None, :]
    return scale[channel].reshape(inputs, outputs_per_group, 1, 1)


class ConvBnFold(RewriteRule):
    name = "conv_bn_fold"
    description = ("Conv or ConvTranspose [+ bias] + inference BatchNormalization -> the same op "
                   "with folded weights + bias")

    def variants(self):
        variants = []
        for op, with_bias in itertools.product(("relax.nn.conv2d", "relax.nn.conv2d_transpose"),
                                               (True, False)):
            x, weight = wildcard(), is_const()
            named = {"x": x, "weight": weight}
            conv = named["conv"] = is_op(op)(x, weight)
            out = conv
            if with_bias:
                named["bias"] = is_const()
                out = is_op("relax.add")(conv, named["bias"])
            stats = {role: is_const() for role in ("gamma", "beta", "mean", "var")}
            named.update(stats)
            named["bn"] = is_op("relax.nn.batch_norm")(out, stats["gamma"], stats["beta"],
                                                       stats["mean"], stats["var"])
            variants.append((is_tuple_get_item(named["bn"], 0), named))
        return variants

    def check(self, matched):
        bn, conv = matched["bn"].attrs, matched["conv"].attrs
        dtype = dtype_of(matched["conv"])
        if dtype not in FLOAT_DTYPES:
            return f"dtype {dtype} is not a float type"
        if bool(bn.training):
            return "the BatchNormalization is in training mode (its statistics change per batch)"
        if int(bn.axis) != 1:
            return f"BatchNormalization normalizes axis {int(bn.axis)}, not the conv's channel axis 1"
        kernel_layout = "IOHW" if _is_transpose(matched) else "OIHW"
        if conv.data_layout != "NCHW" or conv.kernel_layout != kernel_layout or conv.out_layout != "NCHW":
            return f"conv layout {conv.data_layout}/{conv.kernel_layout} is not NCHW/{kernel_layout}"
        if conv.out_dtype and str(conv.out_dtype) not in ("", dtype):
            return f"the conv accumulates into {conv.out_dtype}"
        channels = _output_channels(matched)
        for role in ("gamma", "beta", "mean", "var"):
            if _constant(matched[role]).shape != (channels,):
                return f"BatchNormalization {role} has shape {_constant(matched[role]).shape}, not ({channels},)"
        if "bias" in matched and _constant(matched["bias"]).size != channels:
            return f"conv bias has {_constant(matched['bias']).size} values for {channels} channels"
        return None

    def rewrite(self, matched):
        dtype = str(dtype_of(matched["conv"]))
        weight = _constant(matched["weight"]).astype(np.float64)
        gamma, beta, mean, var = (_constant(matched[r]).astype(np.float64)
                                  for r in ("gamma", "beta", "mean", "var"))
        scale = gamma / np.sqrt(var + float(matched["bn"].attrs.epsilon))
        bias = _constant(matched["bias"]).astype(np.float64).reshape(-1) if "bias" in matched else 0.0
        folded_bias = ((bias - mean) * scale + beta).reshape(1, -1, 1, 1).astype(dtype)
        conv = matched["conv"]
        if _is_transpose(matched):
            scale_weight = _transpose_weight_scale(scale, weight.shape, int(conv.attrs.groups))
            new_conv = relax.op.nn.conv2d_transpose(
                matched["x"], relax.const((weight * scale_weight).astype(dtype)), strides=conv.attrs.strides,
                padding=conv.attrs.padding, output_padding=conv.attrs.output_padding,
                dilation=conv.attrs.dilation, groups=conv.attrs.groups, data_layout="NCHW",
                kernel_layout="IOHW", out_layout="NCHW", out_dtype=conv.attrs.out_dtype)
            return relax.op.add(new_conv, relax.const(folded_bias))
        folded_weight = (weight * scale.reshape(-1, 1, 1, 1)).astype(dtype)
        new_conv = relax.op.nn.conv2d(
            matched["x"], relax.const(folded_weight), strides=conv.attrs.strides,
            padding=conv.attrs.padding, dilation=conv.attrs.dilation, groups=conv.attrs.groups,
            data_layout="NCHW", kernel_layout="OIHW", out_layout="NCHW",
            out_dtype=conv.attrs.out_dtype)
        return relax.op.add(new_conv, relax.const(folded_bias))
