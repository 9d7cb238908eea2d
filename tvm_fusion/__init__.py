"""tvm_fusion: kernel fusion for Apache TVM. ONNX in, fused and scheduled library out.

The entry points load on first use: importing TVM takes a second, and ``tvm-fusion --help``
or a bad flag should not wait for it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_ENTRY_POINTS = {"bench_model": "api", "compile_model": "api", "export_fused_onnx": "api", "inspect_model": "api",
                 "profile_model": "api", "tune_model": "api", "load": "runtime", "TvmFusionError": "errors"}
__all__ = ["__version__", *_ENTRY_POINTS]


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(f".{_ENTRY_POINTS[name]}", __name__), name)
    raise AttributeError(f"module 'tvm_fusion' has no attribute {name!r}")
