"""The fused ONNX of ``conv_bn_fold`` where no epilogue absorbed it: the conv (or conv
transpose) with its BatchNormalization, as a ``ConvEpilogue`` (``ConvTransposeEpilogue``)."""

from ..spec import OnnxSpec
from .conv_epilogue import ConvEpilogue, build_conv
from .conv_transpose_epilogue import ConvTransposeEpilogue

SPEC = OnnxSpec("conv_bn_fold", build_conv, (ConvEpilogue, ConvTransposeEpilogue))
