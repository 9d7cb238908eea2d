"""Conv epilogue: Conv2d (any stride, padding, dilation, groups) + bias + activation + residual
Add (+ activation after it) as one kernel, with an optional per-channel input scale in front.

Every step after the conv is elementwise on its output, so unfused each is a full round trip of
the feature map through memory; fused, the epilogue runs on the conv's output tile while it is
in registers. The input scale is the last step of a squeeze-and-excitation block
(``x * gate[n, c, 1, 1]``): fused as the conv's prologue it costs one multiply per loaded value
instead of a pass over the map. The residual may be an upsampled map (``resize2d``), the
top-down merge of an FPN neck (``lateral_conv(x) + upsample(top)``): fused, each output reads
its pixel of the small top map, and neither the lateral map nor the upsampled one is stored.
Activations are matched in their canonical forms (after the ``clip``, ``silu``, ``hardswish``
and ``hardsigmoid`` rewrites).

Output rows and columns may be symbolic (a model compiled for a range of image sizes): the
kernel tiles them at run time. Batch and channels must be static: the channel tile and the
per-channel bias are chosen at compile time.
"""

from __future__ import annotations

import itertools
import re

from tvm.relax.dpl import is_op, wildcard

from .activations import activation_patterns
from .base import (FusionRule, dims_text, dtype_of, residual_or_leak_reason, shape_dims,
                   static_shape, symbolic_dim_reason, unsupported_dtype_reason)
from .resize_merge import resize_reason


CONV_ACTIVATIONS = activation_patterns(("relu", "clip", "leakyrelu", "prelu", "sigmoid", "silu", "hardsigmoid",
                                        "hardswish"))
# After a residual add, exporters only put plain activations.
POST_RESIDUAL = ("relu", "clip", "hardswish")
# Residual kinds: none, any tensor, or an upsampled map computed inside the kernel.
UPSAMPLED = "upsampled"


def conv_epilogue_pattern(conv_op: str, scaled: bool, bias: bool, activation: str | None,
                          residual: bool | str, post_activation: str | None):
    """``post(act(conv_op([x * gate], w) [+ bias]) [+ residual])`` and its annotations."""
    data, weight = wildcard(), wildcard()
    annotations = {"data": data, "weight": weight}
    if scaled:
        annotations["gate"] = wildcard()
        data = annotations["scale"] = is_op("relax.multiply")(data, annotations["gate"])
    out = annotations["conv"] = is_op(conv_op)(data, weight)
    if bias:
        annotations["bias"] = wildcard()
        out = annotations["bias_add"] = is_op("relax.add")(out, annotations["bias"])
    if activation:
        out = annotations["activation"] = CONV_ACTIVATIONS[activation](out)
    if residual == UPSAMPLED:
        annotations["top"] = wildcard()
        annotations["residual"] = annotations["resize"] = is_op("relax.image.resize2d")(
            annotations["top"], wildcard())
    elif residual:
        annotations["residual"] = wildcard()
    if residual:
        out = annotations["residual_add"] = is_op("relax.add")(out, annotations["residual"])
        if post_activation:
            out = annotations["post_activation"] = CONV_ACTIVATIONS[post_activation](out)
    return out, annotations


def variant_name(prefix: str, scaled, bias, activation, residual, post_activation) -> str:
    parts = [prefix] + (["scaled"] if scaled else []) + (["bias"] if bias else [])
    parts += [activation] if activation else []
    parts += ([UPSAMPLED] if residual == UPSAMPLED else []) + (["residual"] if residual else [])
    parts += [post_activation] if post_activation else []
    return "_".join(parts)


def epilogue_variants(conv_op: str, prefix: str, with_input_scale: bool,
                      residuals: tuple = (True, False)) -> list:
    """Every non-empty epilogue chain on ``conv_op``, named ``prefix_...``, longest first, so
    the biggest chain whose check passes wins."""
    variants = []
    for scaled, bias, activation, residual in itertools.product(
            (True, False) if with_input_scale else (False,), (True, False), (*CONV_ACTIVATIONS, None),
            residuals):
        for post in ((*POST_RESIDUAL, None) if residual else (None,)):
            choice = (scaled, bias, activation, residual, post)
            if any(choice):
                variants.append((variant_name(prefix, *choice), *conv_epilogue_pattern(conv_op, *choice)))
    return sorted(variants, key=lambda v: -len(v[2]))


def bias_reason(found: dict, out_shape: tuple) -> str | None:
    """The bias, when the chain has one, must be one value per output channel (``out_shape``
    from ``shape_dims``: static channels, rows and columns possibly symbolic)."""
    if "bias" not in found:
        return None
    per_channel = per_channel_shapes(out_shape)
    bias_shape = static_shape(found["bias"])
    if bias_shape not in per_channel:
        return f"bias shape {bias_shape} is not one value per output channel (expected {per_channel[0]})"
    return None


class ConvEpilogue(FusionRule):
    name = "conv_epilogue"
    operator = "conv"  # as near misses name it
    runs_before = ("resize_merge",)
    absorbs_elementwise_tail = True
    absorbs_dequantized_input = True
    description = ("conv2d (strided/dilated/grouped/depthwise) + bias + activation (relu, clip, "
                   "leakyrelu, prelu, sigmoid, silu, hardsigmoid, hardswish) + residual add + activation, "
                   "with an optional per-channel input scale (SE) in front")

    def variants(self):
        return epilogue_variants("relax.nn.conv2d", "conv", with_input_scale=True,
                                 residuals=(UPSAMPLED, True, False))

    def anchor(self, context):
        return context.annotated_expr["conv"]

    def check(self, context):
        found = context.annotated_expr
        conv = found["conv"]
        out_shape = shape_dims(conv)
        return (unsupported_dtype_reason(conv) or self.layout_reason(conv.attrs)
                or static_batch_channels_reason(self.operator, out_shape) or bias_reason(found, out_shape)
                or self.input_reason(found) or residual_or_leak_reason(context, dtype_of(conv)))

    def layout_reason(self, attrs) -> str | None:
        layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
        if layouts != ("NCHW", "OIHW", "NCHW") and not is_blocked_conv_layout(*layouts):
            return f"conv layout {attrs.data_layout}/{attrs.kernel_layout} is not NCHW/OIHW or NCHW[x]c"
        return None

    def input_reason(self, found) -> str | None:
        """The upsampled residual and the SE input scale, when the variant has them."""
        if "resize" in found and (reason := resize_reason(found["resize"])):
            return reason
        if "gate" in found:
            return _check_channel_scale(found["data"], found["gate"])
        return None


def is_blocked_conv_layout(data_layout: str, kernel_layout: str, out_layout: str) -> bool:
    """``NCHW{x}c`` output (passes/blocked_layout.py) from ``NCHW{x}c`` data with ``OIHW{x}i{x}o``
    weights, or ``OIHW{x}o`` for a depthwise conv; or from NCHW data with ``OIHW{x}o`` weights."""
    match = re.fullmatch(r"NCHW(\d+)c", out_layout)
    if not match:
        return False
    if data_layout == "NCHW":
        return kernel_layout == f"OIHW{match[1]}o"
    return data_layout == out_layout and kernel_layout in (f"OIHW{match[1]}i{match[1]}o", f"OIHW{match[1]}o")


def static_batch_channels_reason(what: str, out_shape: tuple | None) -> str | None:
    """Batch, channels (and the channel block of NCHW[x]c) must be static; rows and columns
    may be symbolic."""
    if out_shape is None or len(out_shape) not in (4, 5):
        return f"the {what} output {dims_text(out_shape)} is not 4-D NCHW or 5-D NCHW[x]c"
    for axis, role in ((0, "batch"), (1, "channels"), (4, "channel block")):
        if axis < len(out_shape):
            reason = symbolic_dim_reason(f"{what} output", out_shape, axes=(axis,), role=role)
            if reason:
                return reason
    return None


def per_channel_shapes(out_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of a per-output-channel operand (bias) for an NCHW or NCHW[x]c conv output."""
    if len(out_shape) == 5:
        return [(1, out_shape[1], 1, 1, out_shape[4]), (out_shape[1], 1, 1, out_shape[4])]
    return [(1, out_shape[1], 1, 1), (out_shape[1], 1, 1)]


def _check_channel_scale(data, gate) -> str | None:
    """The input scale must be ``map * gate`` with gate one value per (batch, channel), in
    NCHW or NCHW[x]c; the map's rows and columns may be symbolic, its batch and channels must
    be static."""
    first, second = shape_dims(data), shape_dims(gate)
    if first is None or second is None or len(first) != len(second) or len(first) not in (4, 5):
        return "the conv input is a product of tensors that are not both 4-D (or both 5-D NCHW[x]c)"
    full, per_channel = (first, second) if _is_one(second[2]) and _is_one(second[3]) else (second, first)
    reason = symbolic_dim_reason("scaled conv input", full, axes=(0, 1, 4)[:len(full) - 2])
    if reason:
        return reason
    if not (_is_one(per_channel[2]) and _is_one(per_channel[3])) or per_channel[1] != full[1] \
            or per_channel[0] not in (1, full[0]) or per_channel[4:] != full[4:]:
        return (f"the conv input is scaled by shape {dims_text(per_channel)}, not one value per "
                f"channel of {dims_text(full)}")
    return None


def _is_one(dim) -> bool:
    return isinstance(dim, int) and dim == 1
