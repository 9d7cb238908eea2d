"""The Python API: compile, inspect, bench, profile and ablate, usable without the CLI.

Each entry point takes a model path, an optional config (path or PipelineConfig) and optional
input shapes, and raises a ``TvmFusionError`` subclass for anything the user can fix.

This module only gathers them; the work is done in the modules below it:

* ``preparation``: load, bind shapes, simplify, import into Relax; memory and one-size checks
* ``build``: the tvm_fusion pipeline on one imported model, ``tvm.compile``, stock TVM's build
* ``compilation``: ``compile_model`` / ``compile_targets``: per target build, export, verify
* ``metadata``: what an artifact's metadata.json says
* ``inspection``: ``inspect_model`` and ``export_fused_onnx``
* ``bench``, ``profile``, ``ablate``: timing
"""

from __future__ import annotations

from .ablate import ablate_model
from .bench import BenchReport, bench_model
from .build import (OptimizedModule, build, build_stock, callable_module, kernel_calls, load_tuning, optimize,
                    stock_kernel_calls)
from .compilation import CompileResult, TargetResult, compile_model, compile_targets
from .errors import TvmFusionError
from .inspection import (FusedNodes, FusedOnnxReport, InspectReport, export_fused_onnx, fused_nodes,
                         inspect_model, relax_op_counts)
from .preparation import (PreparedModel, Progress, ShapeArg, at_one_size, check_memory, parse_input_shapes,
                          prepare, resolve_config, shapes_text)
from .profile import profile_model

__all__ = [
    # entry points
    "compile_model", "compile_targets", "inspect_model", "export_fused_onnx", "bench_model",
    "profile_model", "ablate_model",
    # their results
    "CompileResult", "TargetResult", "InspectReport", "FusedNodes", "FusedOnnxReport", "BenchReport",
    # the steps, for scripts and tests that build a model piece by piece
    "prepare", "PreparedModel", "parse_input_shapes", "resolve_config", "at_one_size", "check_memory",
    "shapes_text", "optimize", "OptimizedModule", "load_tuning", "build", "build_stock", "callable_module",
    "kernel_calls", "stock_kernel_calls", "fused_nodes", "relax_op_counts",
    "Progress", "ShapeArg", "TvmFusionError",
]
