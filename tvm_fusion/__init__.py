"""tvm_fusion: kernel fusion for Apache TVM. ONNX in, fused and scheduled library out."""

__version__ = "0.1.0"

from .api import bench_model, compile_model, export_fused_onnx, inspect_model  # noqa: E402
from .errors import TvmFusionError  # noqa: E402
from .runtime import load  # noqa: E402

__all__ = ["__version__", "bench_model", "compile_model", "export_fused_onnx", "inspect_model", "load",
           "TvmFusionError"]
