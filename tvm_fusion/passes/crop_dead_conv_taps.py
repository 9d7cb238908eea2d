"""CropDeadConvTaps: the kernel rows and columns of a conv that only ever read padding, dropped.

Tap row ``k`` of a conv reads input rows ``y * stride + k * dilation - pad_top`` for the output
rows ``y``; where none of those lies inside the map, every product it adds is a weight times the
zero padding. DeepLabV3's ASPP convs (3x3, dilation and padding 12, 24, 36) over the 16x20 map
of a 256x320 input read only padding with all eight outer taps at dilations 24 and 36: they are
1x1 convs computed with 9x the multiply-adds, 60 % of that model's time before this pass. A 3x3
conv over a one-row map (a text line's features) has dead top and bottom rows likewise.

The conv keeps its live taps ``k0..k1`` of each axis, its padding reduced by the dropped taps'
reach (``pad_top - k0 * dilation``), so every output reads the same inputs with the same
weights and the output grid is unchanged; an axis left with one tap gets dilation 1. The
result is exact: only products with padding are gone. Convs whose map is symbolic, whose
weight is not a constant, or whose padding would go negative are left as they are.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from .rebinding import replace_values

CONV2D = "relax.nn.conv2d"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.CropDeadConvTaps")
class CropDeadConvTaps:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_values(mod, cropped_conv)


def live_taps(size: int, out_size: int, taps: int, stride: int, dilation: int, pad_before: int) -> tuple[int, int] | None:
    """(first, last) tap of one axis that reads inside the map for some output; None if none does."""
    live = [k for k in range(taps)
            if any(0 <= y * stride + k * dilation - pad_before < size for y in range(out_size))]
    return (live[0], live[-1]) if live else None


def cropped_conv(value) -> relax.Call | None:
    """An NCHW conv2d with a constant OIHW weight and dead taps, as the conv of its live taps;
    None for any other expression."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(CONV2D)
            and isinstance(value.args[1], tvm.ir.GenericConst)):
        return None
    attrs = value.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return None
    in_shape, out_shape = value.args[0].ty.shape, value.ty.shape
    if in_shape is None or out_shape is None:
        return None
    dims = [in_shape[2], in_shape[3], out_shape[2], out_shape[3]]
    if not all(isinstance(dim, tirx.IntImm) for dim in dims):
        return None
    weight = value.args[1].value.numpy()
    strides, dilation = [int(v) for v in attrs.strides], [int(v) for v in attrs.dilation]
    padding = [int(v) for v in attrs.padding]  # top, left, bottom, right
    spans, new_padding, new_dilation = [], [0, 0, 0, 0], list(dilation)
    for axis in range(2):
        taps = weight.shape[2 + axis]
        live = live_taps(int(dims[axis]), int(dims[2 + axis]), taps, strides[axis], dilation[axis], padding[axis])
        if live is None:
            return None  # the output is the bias alone: rare enough to leave to the conv
        first, last = live
        new_padding[axis] = padding[axis] - first * dilation[axis]
        new_padding[2 + axis] = padding[2 + axis] - (taps - 1 - last) * dilation[axis]
        if first == last:
            new_dilation[axis] = 1
        spans.append(slice(first, last + 1))
    if spans[0] == slice(0, weight.shape[2]) and spans[1] == slice(0, weight.shape[3]):
        return None
    if min(new_padding) < 0:
        return None  # the live taps would read before the map: that needs a slice of the input
    return relax.op.nn.conv2d(value.args[0], relax.const(np.ascontiguousarray(weight[:, :, spans[0], spans[1]])),
                              strides=strides, padding=new_padding, dilation=new_dilation, groups=int(attrs.groups),
                              data_layout="NCHW", kernel_layout="OIHW", out_layout="NCHW", out_dtype=attrs.out_dtype)
