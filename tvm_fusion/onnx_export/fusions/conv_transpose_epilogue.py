"""``ConvTransposeEpilogue``: the fused ONNX of ``conv_transpose_epilogue``, written by
``conv_epilogue``'s builder, and its reference implementation."""

from __future__ import annotations

from ..reference_ops import FusedOp
from ..spec import OnnxSpec
from .conv_epilogue import build_conv, conv_epilogue


class ConvTransposeEpilogue(FusedOp):
    """ConvTranspose + bias + inference BatchNormalization + activation + residual + activation + tail."""

    def _run(self, x, w, bias=None, bn_scale=None, bn_bias=None, bn_mean=None, bn_var=None,
             residual_map=None, *tail_operands, **attributes):
        return (conv_epilogue("ConvTranspose", x, w, bias, None, (bn_scale, bn_bias, bn_mean, bn_var),
                              residual_map, tail_operands, attributes),)


SPEC = OnnxSpec("conv_transpose_epilogue", build_conv, (ConvTransposeEpilogue,))
