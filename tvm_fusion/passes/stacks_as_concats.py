"""Stacks as concats for TVM's layout inference, and back again.

TVM's ``ConvertLayout`` fails on what a ``stack`` feeds, so ``ConvertConvsToBlockedLayout``
rewrites every stack as a concat of its inputs with the new axis inserted before the inference
and turns such concats back into stacks after it.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


def stacks_as_concats(mod: tvm.IRModule) -> tvm.IRModule:
    """Every ``stack`` as the concat of its inputs, each with the new axis inserted (a new
    module: the caller keeps the old one). TVM's layout inference fails on what a stack feeds
    (``Index -1 out of bounds``, an LSTM's outputs stacked over the steps, then over the
    directions), which kept every model with a bidirectional LSTM in NCHW."""
    return _rewrite_functions(mod, _StackAsConcat)


def concats_as_stacks(mod: tvm.IRModule) -> tvm.IRModule:
    """Back again after the layout inference: a concat of 64 inputs is lowered as a chain of
    selects per element (ddddocr's LSTM output 31 -> 247 us as a concat)."""
    return _rewrite_functions(mod, _ConcatAsStack)


def _rewrite_functions(mod: tvm.IRModule, mutator_class) -> tvm.IRModule:
    """``mod`` with each Relax function the mutator rewrote replaced (the others untouched:
    the mutator's rebuilding alone would renormalize them)."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            rewriter = mutator_class(mod)
            rewritten = rewriter.visit_expr(func)
            if rewriter.rewrote:
                mod[gvar] = relax.analysis.remove_all_unused(rewritten)
    return mod


@mutator
class _StackAsConcat(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not call.op.same_as(tvm.ir.Op.get("relax.stack")):
            return self.visit_expr_post_order(call)
        ndim = call.ty.ndim
        call = self.visit_expr_post_order(call)
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple):
            count = len(parts.ty.fields)
            parts = relax.Tuple([relax.TupleGetItem(parts, index) for index in range(count)])
        axis = int(call.attrs.axis) % ndim
        self.rewrote = True
        return relax.op.concat([relax.op.expand_dims(part, axis) for part in parts.fields], axis)


@mutator
class _ConcatAsStack(PyExprMutator):
    """``concat([expand_dims(x_i, a)...], a)`` -> ``stack([x_i...], a)``."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not call.op.same_as(tvm.ir.Op.get("relax.concat")) or not isinstance(call.args[0], relax.Tuple):
            return call
        axis = int(call.attrs.axis)
        inputs = []
        for part in call.args[0].fields:
            value = self.lookup_binding(part) if isinstance(part, relax.Var) else part
            if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.expand_dims"))
                    and [int(a) for a in value.attrs.axis] == [axis]):
                return call
            inputs.append(value.args[0])
        self.rewrote = True
        return relax.op.stack(inputs, axis)
