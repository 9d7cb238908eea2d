"""FlushSubnormalConstants: the subnormal values of float32 constants set to zero, once at build time.

An x86 multiply or FMA with a subnormal operand takes a microcode assist of about a hundred
cycles (the DAZ flag that would skip it is off in the processes we run in). Training and folding
a BatchNorm into conv weights leave a few such weights, and every FMA of a vector holding one
takes the assist, once per output pixel: PP-OCRv4-rec's SE-scaled 480 -> 480 1x1 conv carries
13 among its 230,400 weights and ran 1390 us on them against 990 us on random weights (kernel
alone, 2 threads, Emerald Rapids), 4 % of the model. OpenVINO's CPU plugin flushes its
constants the same way.

A subnormal weight ``w`` adds less than ``1.2e-38 * |x|`` to a sum: nothing at float32's
resolution unless the output itself is below about 1e-31. Float16 constants keep theirs (the
hardware converts them to normal float32 values without an assist).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rebinding import mutate_functions


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FlushSubnormalConstants")
class FlushSubnormalConstants:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_functions(mod, _Flusher)


def flushed(array: np.ndarray) -> np.ndarray | None:
    """``array`` with its subnormal values replaced by zeros of the same sign; None when it has
    none (or is not float32)."""
    if array.dtype != np.float32:
        return None
    subnormal = _subnormal(array)
    if not subnormal.any():
        return None
    return np.where(subnormal, np.copysign(np.float32(0), array), array)


def subnormal_count(mod: tvm.IRModule) -> int:
    """Subnormal values over the distinct float32 constants of ``mod``'s Relax functions."""
    constants = {}
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda expr: constants.setdefault(expr, None) if _is_float32(expr) else None)
    return sum(int(_subnormal(const.value.numpy()).sum()) for const in constants)


def _is_float32(expr) -> bool:
    """A float32 constant: its dtype is read before its values are copied out (an int8 weight
    of a quantized model is not copied at all)."""
    return isinstance(expr, tvm.ir.GenericConst) and expr.value.dtype == "float32"


def _subnormal(array: np.ndarray) -> np.ndarray:
    return (array != 0) & (np.abs(array) < np.finfo(np.float32).tiny)


@mutator
class _Flusher(PyExprMutator):
    """Each constant flushed once: one shared by several calls stays one constant."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.done: dict = {}

    def visit_generic_const_(self, const: tvm.ir.GenericConst) -> relax.Expr:
        if const not in self.done:
            value = flushed(const.value.numpy()) if _is_float32(const) else None
            self.done[const] = const if value is None else relax.const(value, "float32")
        return self.done[const]
