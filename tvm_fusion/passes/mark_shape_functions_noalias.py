"""MarkShapeFunctionsNoAlias: ``tirx.noalias`` on the VM's shape functions, so kernels built
beside them keep their accumulators in registers.

A module with symbolic shapes gets a ``shape_func`` from ``VMShapeLower`` (it computes the
run-time sizes into one int64 heap buffer), and it lacks the ``tirx.noalias`` attribute every
kernel has. In TVM 0.27 that one function is enough for the LLVM codegen to treat the
buffers of every function in the module as possibly aliased: the register-blocked conv
kernels then store their accumulator tile after every FMA, which ran resnet_tiny's dynamic
build 2-3x slower than the same kernels built alone. A shape function has a single buffer
parameter, so marking it noalias promises nothing false.
"""

from __future__ import annotations

import tvm
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.MarkShapeFunctionsNoAlias")
class MarkShapeFunctionsNoAlias:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        marked = mod.clone()
        for gvar, func in mod.functions_items():
            if _is_unmarked_shape_function(func):
                marked[gvar] = func.with_attr("tirx.noalias", True)
        return marked


def _is_unmarked_shape_function(func) -> bool:
    if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
        return False
    if not func.attrs.get("tirx.is_host_func", False) or func.attrs.get("tirx.noalias", False):
        return False
    return sum(1 for param in func.params if hasattr(param, "shape")) <= 1
