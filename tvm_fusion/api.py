"""The Python API: compile, inspect, bench, profile and ablate, usable without the CLI.

Each entry point takes a model path, an optional config (path or PipelineConfig) and optional
input shapes, and raises a ``TvmFusionError`` subclass for anything the user can fix.

This module only gathers them; the work is done below it:

* ``session.ModelSession``: one model's stages (prepared, fused, lowered, scheduled, built),
  each computed once and shared by every command
* ``preparation``: load, bind shapes, simplify, import into Relax; memory and one-size checks
* ``build``: tuning records, ``tvm.compile``, kernel counts
* ``commands``: ``compile`` (per-target build, export, verify), ``inspect`` (and the fused ONNX
  export), ``bench``, ``profile``, ``ablate``, ``tune``
* ``metadata``: what an artifact's metadata.json says
"""

from __future__ import annotations

from .build import build, callable_module, kernel_calls, load_tuning
from .commands.ablate import ablate_model
from .commands.bench import BenchReport, bench_model
from .commands.compile import CompileResult, TargetResult, compile_model, compile_targets
from .commands.inspect import (FusedNodes, FusedOnnxReport, InspectReport, export_fused_onnx, fused_nodes,
                               inspect_model, relax_op_counts)
from .commands.profile import profile_model
from .commands.tune import tune_model
from .errors import TvmFusionError
from .preparation import (PreparedModel, Progress, ShapeArg, at_one_size, check_memory, parse_input_shapes,
                          prepare, resolve_config, shapes_text)
from .session import ModelSession, Scheduled, optimize

__all__ = [
    # entry points
    "compile_model", "compile_targets", "inspect_model", "export_fused_onnx", "bench_model",
    "profile_model", "ablate_model", "tune_model",
    # their results
    "CompileResult", "TargetResult", "InspectReport", "FusedNodes", "FusedOnnxReport", "BenchReport",
    # the stages, for scripts and tests that build a model piece by piece
    "ModelSession", "Scheduled", "prepare", "PreparedModel", "parse_input_shapes", "resolve_config",
    "at_one_size", "check_memory", "shapes_text", "optimize", "load_tuning", "build", "callable_module",
    "kernel_calls", "fused_nodes", "relax_op_counts",
    "Progress", "ShapeArg", "TvmFusionError",
]
