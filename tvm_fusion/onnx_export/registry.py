"""The fused ONNX of every registered pattern, found by module: no list here names a pattern.

Each pattern with a fused ONNX op has a module named after it in ``fusions/`` whose ``SPEC``
(``spec.OnnxSpec``) holds its builder and the OpRun of each op it writes; a plugin's pattern
brings its own through the ``tvm_fusion.onnx_export`` entry point group. ``builders`` and
``fused_ops`` read them in the pattern registry's order, so adding a fusion with its module
adds its export and its reference op; a pattern without one keeps its ONNX nodes.
"""

from __future__ import annotations

import importlib
import pkgutil

import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..errors import PluginError
from ..patterns import pattern_registry
from ..plugins import plugin_rules
from . import fusions
from .spec import Builder, OnnxSpec
from .standard_ops import STANDARD_FIXES

ENTRY_POINT_GROUP = "tvm_fusion.onnx_export"


def onnx_specs() -> dict[str, OnnxSpec]:
    """Pattern name -> its spec, in the pattern registry's order (patterns without one left out);
    PluginError for a spec that names no registered pattern, or a second spec of one pattern."""
    found = [*builtin_specs(), *plugin_rules(ENTRY_POINT_GROUP, (OnnxSpec,), name_of=lambda spec: spec.pattern)]
    registered = pattern_registry()
    by_pattern: dict[str, OnnxSpec] = {}
    for spec in found:
        where = f"the fused ONNX spec in {spec.build.__module__}"
        if spec.pattern not in registered:
            raise PluginError(f"{where} is for {spec.pattern!r}, which is no registered pattern",
                              "name the pattern as its rule's `name` says")
        if spec.pattern in by_pattern:
            raise PluginError(f"{where} is a second spec for pattern {spec.pattern!r} "
                              f"(the first is in {by_pattern[spec.pattern].build.__module__})", "keep one of them")
        by_pattern[spec.pattern] = spec
    return {name: by_pattern[name] for name in registered if name in by_pattern}


def builtin_specs() -> list[OnnxSpec]:
    """The ``SPEC`` of each module in ``fusions/`` (modules without one are shared by several)."""
    modules = (importlib.import_module(f"{fusions.__name__}.{info.name}")
               for info in pkgutil.iter_modules(fusions.__path__))
    return [module.SPEC for module in modules if isinstance(getattr(module, "SPEC", None), OnnxSpec)]


def builders() -> dict[str, Builder]:
    """Pattern name -> the builder that writes one of its matches as ``tvm_fusion`` nodes."""
    return {name: spec.build for name, spec in onnx_specs().items()}


def fused_ops() -> list[type[OpRun]]:
    """The OpRun of every ``tvm_fusion`` op, once each, in the pattern registry's order;
    PluginError where two specs define an op of the same name differently."""
    ops: dict[str, type[OpRun]] = {}
    for name, spec in onnx_specs().items():
        for op in spec.ops:
            known = ops.setdefault(op.__name__, op)
            if known is not op:
                raise PluginError(f"pattern {name!r} defines the fused ONNX op {op.__name__!r} in {op.__module__}, "
                                  f"and {known.__module__} defines another",
                                  "rename one of the ops (the class name is the op type)")
    return list(ops.values())


def evaluator(model: onnx.ModelProto) -> ReferenceEvaluator:
    """A ReferenceEvaluator for a fused model: the standard ops (``STANDARD_FIXES`` where
    onnx.reference departs from ONNX Runtime) plus every registered pattern's fused ops."""
    return ReferenceEvaluator(model, new_ops=fused_ops() + STANDARD_FIXES)
