"""SinkTransposes: move transposes past element-wise ops until they meet their inverse.

Models converted from channels-last frameworks (TensorFlow/Keras via onnx2torch or tf2onnx,
open-NSFW) wrap every conv in ``Transpose(NHWC->NCHW) -> Conv -> Transpose(NCHW->NHWC)`` and
run the bias, batch-norm and activation in NHWC. Then no conv is followed by its epilogue: the
transpose sits between, and each transpose is a kernel that moves the whole map. Element-wise
ops commute with a transpose (``op(t(a), t(b), c) == t(op(a, b, t'(c)))``, the constant
permuted to match), so each transpose is pushed below the element-wise ops after it; where it
meets a transpose that undoes it the two cancel, and the conv, its epilogue and the next conv
sit next to each other in NCHW.

The rewrite is kept for a function only when it leaves fewer transposes than it found: pushed
below an op that has other users, a transpose can be duplicated instead of cancelled.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

# Ops computed per element (with numpy broadcasting): they commute with any transpose.
ELEMENTWISE_OPS = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power", "relax.maximum",
    "relax.minimum", "relax.where", "relax.clip", "relax.nn.relu", "relax.nn.leakyrelu",
    "relax.sigmoid", "relax.tanh", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh",
    "relax.negative", "relax.abs", "relax.exp", "relax.sqrt", "relax.rsqrt", "relax.erf",
    "relax.astype", "relax.log", "relax.floor", "relax.ceil", "relax.round",
})
SUFFIX = "_transposed"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.SinkTransposes")
class SinkTransposes:
    """Transposes pushed below element-wise ops, cancelled against their inverses."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and "Composite" in func.attrs):
                continue
            sunk = relax.analysis.remove_all_unused(_Sinker(mod).visit_expr(func))
            if transpose_count(sunk) < transpose_count(func):
                updates[gvar] = sunk
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def transpose_count(func: relax.Function) -> int:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.permute_dims"):
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return len(found)


def _axes(call: relax.Call, rank: int) -> tuple[int, ...]:
    axes = call.attrs.axes
    return tuple(range(rank - 1, -1, -1)) if axes is None else tuple(int(a) for a in axes)


def _rank(expr) -> int | None:
    ty = expr.ty
    return ty.ndim if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None


def _is_all_ones(expr) -> bool:
    """A tensor that broadcasts the same way in any layout: a scalar or all dims 1."""
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return _rank(expr) == 0
    return all(isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1 for dim in shape.values)


@mutator
class _Sinker(PyExprMutator):
    """One walk in binding order: ``transposed[var] = (source, axes)`` for every variable that
    is ``permute_dims(source, axes)``, so an op reading only such variables (and constants)
    is re-emitted on the sources and followed by one transpose of its own."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.transposed: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.builder_.normalize(self.visit_expr(binding.value))
        if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.permute_dims"):
            self._emit_transpose(binding.var, value.args[0], _axes(value, _rank(value.args[0]) or 0))
            return
        sunk = self._sunk(value)
        if sunk is None:
            self.set_var_remap(binding.var, self._emit_like(binding.var, binding.var.name, value))
            return
        call, axes = sunk
        source = self.builder_.emit(call, str(binding.var.name))
        self._emit_transpose(binding.var, source, axes)

    def _emit_like(self, old: relax.Var, name: str, value: relax.Expr) -> relax.Var:
        """``value`` bound to a new variable of ``old``'s kind (graph outputs stay outputs)."""
        value = self.builder_.normalize(value)
        var = (relax.DataflowVar if isinstance(old, relax.DataflowVar) else relax.Var)(name, value.ty)
        self.builder_.emit_normalized(relax.VarBinding(var, value))
        return var

    def _emit_transpose(self, old: relax.Var, source: relax.Expr, axes: tuple[int, ...]) -> None:
        """``old = permute_dims(source, axes)``, composed with ``source``'s own transpose."""
        if source in self.transposed:
            inner, first = self.transposed[source]
            source, axes = inner, tuple(first[a] for a in axes)
        if axes == tuple(range(len(axes))):  # met its inverse
            cancelled = source if isinstance(old, relax.DataflowVar) else self._emit_like(old, old.name, source)
            self.set_var_remap(old, cancelled)
            return
        # A sunk op took the old name (that is the ONNX node it computes); its transpose is new.
        name = f"{old.name}{SUFFIX}" if isinstance(source, relax.Var) and source.name == old.name else str(old.name)
        var = self._emit_like(old, name, relax.op.permute_dims(source, list(axes)))
        self.transposed[var] = (source, axes)
        self.set_var_remap(old, var)

    def _sunk(self, call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """``call`` on the untransposed sources, and the transpose to apply after it; None when
        some tensor operand is neither a transposed variable (with the same axes, at full
        rank), a constant, nor layout-free."""
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                and call.op.name in ELEMENTWISE_OPS):
            return None
        axes = next((self.transposed[arg][1] for arg in call.args if arg in self.transposed), None)
        if axes is None or _rank(call) != len(axes):
            return None
        inverse = tuple(int(a) for a in np.argsort(axes))
        args = []
        for arg in call.args:
            if arg in self.transposed:
                source, arg_axes = self.transposed[arg]
                if arg_axes != axes:
                    return None
                args.append(source)
            elif isinstance(arg, tvm.ir.GenericConst):
                args.append(_permuted_constant(arg, inverse))
            elif not isinstance(arg.ty, relax.TensorType) or _is_all_ones(arg):
                args.append(arg)
            else:
                return None
        return relax.Call(call.op, args, call.attrs, call.ty_args), axes


def _permuted_constant(constant: tvm.ir.GenericConst, inverse: tuple[int, ...]) -> tvm.ir.GenericConst:
    """The constant that broadcasts against the untransposed tensor as ``constant`` did against
    the transposed one: padded to full rank with leading 1s, then permuted back."""
    value = constant.value.numpy()
    if value.ndim == 0:
        return constant
    value = value.reshape((1,) * (len(inverse) - value.ndim) + value.shape)
    return relax.const(np.ascontiguousarray(np.transpose(value, inverse)), str(value.dtype))
