"""Squeeze-and-excitation gate: GlobalAveragePool -> 1x1 Conv -> act -> 1x1 Conv -> gate, one kernel.

The pool reduces the whole feature map, so it cannot share a kernel with the map's producer;
everything after it works on one value per channel (a few hundred multiply-adds), and as
separate kernels it is six launches of almost no work. Fused, the gate costs one pass over the
map (the pool) plus a tiny tail. The final ``map * gate`` is left to ``conv_epilogue``, which
folds it into the next conv's input loads (its ``conv_scaled_*`` variants).

The pooled map's rows and columns may be symbolic (the pool sums whatever size it gets); its
batch and channels must be static, as the squeeze convs' weights fix them. In the blocked
layout (NCHW[x]c, with ``blocked_depthwise``) the gate is computed on blocks of channels too.
"""

from __future__ import annotations

import itertools

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard

from .activations import ACTIVATIONS
from .base import FLOAT_DTYPES, FusionRule, dims_text, dtype_of, shape_dims, static_shape, symbolic_dim_reason
from .conv_epilogue import is_blocked_conv_layout, per_channel_shapes

SQUEEZE_ACTIVATIONS = ("relu", "hardswish", "silu")
GATES = ("hardsigmoid", "sigmoid")


def squeeze_excitation_pattern(activation: str, gate: str):
    data = wildcard()
    annotations = {"data": data}
    pooled = annotations["pool"] = is_op("relax.mean")(data)
    out = pooled
    for index, act in ((1, activation), (2, gate)):
        annotations[f"weight{index}"], annotations[f"bias{index}"] = wildcard(), wildcard()
        conv = annotations[f"conv{index}"] = is_op("relax.nn.conv2d")(out, annotations[f"weight{index}"])
        # A conv without a bias too: torch's dynamo exporter drops an all-zero one.
        out = ACTIVATIONS[act](is_op("relax.add")(conv, annotations[f"bias{index}"]) | conv)
    return out, annotations


class SqueezeExcitation(FusionRule):
    name = "squeeze_excitation"
    runs_before = ("conv_epilogue",)
    merges_pooled_gates = True  # the gates these patterns do not spell: a quantized model's
    description = "GlobalAveragePool -> 1x1 conv [+ bias] -> act -> 1x1 conv [+ bias] -> (hard)sigmoid: one kernel"

    def variants(self):
        return [(f"se_{act}_{gate}", *squeeze_excitation_pattern(act, gate))
                for act, gate in itertools.product(SQUEEZE_ACTIVATIONS, GATES)]

    def anchor(self, context):
        return context.annotated_expr["pool"]

    def check(self, context):
        found = context.annotated_expr
        data_shape = shape_dims(found["data"])
        if dtype_of(found["data"]) not in FLOAT_DTYPES:
            return f"dtype {dtype_of(found['data'])} is not a float type"
        if data_shape is None or len(data_shape) not in (4, 5):
            return f"the pooled map has shape {dims_text(data_shape)}, not 4-D NCHW or 5-D NCHW[x]c"
        reason = symbolic_dim_reason("pooled map", data_shape, axes=(0, 1, 4)[:len(data_shape) - 2])
        if reason:
            return reason
        pool = found["pool"].attrs
        if sorted(int(a) % len(data_shape) for a in pool.axis) != [2, 3] or not pool.keepdims:
            return "the mean is not a global average pool over H and W with kept dims"
        for index in (1, 2):
            conv = found[f"conv{index}"].attrs
            weight = static_shape(found[f"weight{index}"])
            if weight is None or weight[2:4] != (1, 1) or int(conv.groups) != 1:
                return f"squeeze conv {index} is not a dense 1x1 conv (weight {weight})"
            layouts = (conv.data_layout, conv.kernel_layout, conv.out_layout)
            if layouts != ("NCHW", "OIHW", "NCHW") and not (
                    is_blocked_conv_layout(*layouts) and conv.data_layout == conv.out_layout):
                return f"squeeze conv {index} layout is {conv.data_layout}/{conv.kernel_layout}"
            out_shape = static_shape(found[f"conv{index}"])
            if f"bias{index}" in found and static_shape(found[f"bias{index}"]) not in per_channel_shapes(out_shape):
                return (f"squeeze conv {index} bias shape {static_shape(found[f'bias{index}'])} is not one "
                        "value per channel")
        if has_leaking_intermediate_variables(context):
            return "an intermediate result is also used outside the block"
        return None
