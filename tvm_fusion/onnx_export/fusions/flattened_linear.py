"""The fused ONNX of ``flattened_linear``: the MatMul it leaves is a ``GemmEpilogue``."""

from ..spec import OnnxSpec
from .gemm_epilogue import GemmEpilogue, build_gemm

SPEC = OnnxSpec("flattened_linear", build_gemm, (GemmEpilogue,))
