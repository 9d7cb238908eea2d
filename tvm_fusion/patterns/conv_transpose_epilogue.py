"""ConvTranspose epilogue: conv2d_transpose + bias + activation + residual Add (+ activation)
as one kernel.

Decoder heads (DBNet, U-Net, FPN upsampling) end in ``ConvTranspose -> [BN] -> activation``;
the BN is folded into the weights and bias by ``conv_bn_fold``, which leaves a per-channel
bias add. The importer spells ONNX's bias input as a separate ``add`` of a ``(1, C, 1, 1)``
constant, so unfused the bias and the activation are two more passes over a map that is
``stride**2`` times larger than the decoder's input. Fused, they run on the output tile.
"""

from __future__ import annotations

import itertools

from tvm.relax.dpl import is_op, wildcard

from .base import FLOAT_DTYPES, FusionRule, dtype_of, residual_or_leak_reason, static_shape
from .conv_epilogue import ACTIVATIONS, POST_RESIDUAL


def conv_transpose_epilogue_pattern(bias: bool, activation: str | None, residual: bool,
                                    post_activation: str | None):
    """``post(act(conv2d_transpose(x, w) [+ bias]) [+ residual])`` and its annotations."""
    data, weight = wildcard(), wildcard()
    annotations = {"data": data, "weight": weight}
    out = annotations["conv"] = is_op("relax.nn.conv2d_transpose")(data, weight)
    if bias:
        annotations["bias"] = wildcard()
        out = annotations["bias_add"] = is_op("relax.add")(out, annotations["bias"])
    if activation:
        out = annotations["activation"] = ACTIVATIONS[activation](out)
    if residual:
        annotations["residual"] = wildcard()
        out = annotations["residual_add"] = is_op("relax.add")(out, annotations["residual"])
        if post_activation:
            out = annotations["post_activation"] = ACTIVATIONS[post_activation](out)
    return out, annotations


def variant_name(bias, activation, residual, post_activation) -> str:
    parts = ["conv_transpose"] + (["bias"] if bias else []) + ([activation] if activation else [])
    parts += (["residual"] if residual else []) + ([post_activation] if post_activation else [])
    return "_".join(parts)


class ConvTransposeEpilogue(FusionRule):
    name = "conv_transpose_epilogue"
    description = ("conv2d_transpose (strided/padded/grouped, output_padding) + bias + activation "
                   "(relu, clip, leakyrelu, sigmoid, silu, hardsigmoid, hardswish) + residual add "
                   "+ activation")

    def variants(self):
        variants = []
        for bias, activation, residual in itertools.product(
                (True, False), (*ACTIVATIONS, None), (True, False)):
            for post in ((*POST_RESIDUAL, None) if residual else (None,)):
                choice = (bias, activation, residual, post)
                if any(choice):
                    variants.append((variant_name(*choice), *conv_transpose_epilogue_pattern(*choice)))
        # Longest chain first, so the biggest chain whose check passes wins.
        return sorted(variants, key=lambda v: -len(v[2]))

    def anchor(self, context):
        return context.annotated_expr["conv"]

    def check(self, context):
        found = context.annotated_expr
        conv = found["conv"]
        attrs = conv.attrs
        dtype = dtype_of(conv)
        if dtype not in FLOAT_DTYPES:
            return f"dtype {dtype} is not supported ({', '.join(FLOAT_DTYPES)})"
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "IOHW", "NCHW"):
            return (f"conv_transpose layout {attrs.data_layout}/{attrs.kernel_layout}/"
                    f"{attrs.out_layout} is not NCHW/IOHW/NCHW (the only one TOPI lowers)")
        out_shape = static_shape(conv)
        if out_shape is None:
            return "the conv_transpose output shape is not static (bind the dynamic dims)"
        channels = out_shape[1]
        if "bias" in found:
            bias_shape = static_shape(found["bias"])
            if bias_shape not in ((1, channels, 1, 1), (channels, 1, 1)):
                return (f"bias shape {bias_shape} is not one value per output channel "
                        f"(expected (1, {channels}, 1, 1))")
        return residual_or_leak_reason(context, dtype)
