"""SinkViews: move transposes and unit-axis squeezes past element-wise ops until they meet
their inverse.

Models converted from channels-last frameworks (TensorFlow/Keras via onnx2torch or tf2onnx,
open-NSFW) wrap every conv in ``Transpose(NHWC->NCHW) -> Conv -> Transpose(NCHW->NHWC)`` and
run the bias, batch-norm and activation in NHWC. Then no conv is followed by its epilogue: the
transpose sits between, and each transpose is a kernel that moves the whole map. A Conv1d
computed as a one-row Conv2d (``Conv1dAsConv2d``) is followed by the squeeze of that row in
the same way. Element-wise ops commute with both views (``op(v(a), v(b), c) == v(op(a, b,
v⁻¹(c)))``, the constant laid out to match), so each view is pushed below the element-wise ops
after it; where it meets the view that undoes it (the inverse transpose, the next conv's
``expand_dims``) the two cancel, and the conv, its epilogue and the next conv sit next to each
other in one layout.

The rewrite is kept for a function only when it leaves fewer views than it found, or as many
with fewer of them right after a conv or matmul (the output of a one-row conv that is pooled,
a channels-last model's last layer: the epilogue then fuses): pushed below an op that has other
users, a view can be duplicated instead of cancelled.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rebinding import rebind

# Ops computed per element (with numpy broadcasting): they commute with any transpose.
ELEMENTWISE_OPS = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power", "relax.maximum",
    "relax.minimum", "relax.where", "relax.clip", "relax.nn.relu", "relax.nn.leakyrelu",
    "relax.sigmoid", "relax.tanh", "relax.nn.silu", "relax.nn.gelu", "relax.nn.gelu_tanh",
    "relax.negative", "relax.abs", "relax.exp", "relax.sqrt", "relax.rsqrt", "relax.erf",
    "relax.astype", "relax.log", "relax.floor", "relax.ceil", "relax.round",
    "relax.less", "relax.less_equal", "relax.greater", "relax.greater_equal", "relax.equal", "relax.not_equal",
})
VIEW_OPS = ("relax.permute_dims", "relax.squeeze", "relax.expand_dims")
SUFFIX = "_view"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.SinkViews")
class SinkViews:
    """Transposes and unit-axis squeezes pushed below element-wise ops, cancelled against
    their inverses."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and "Composite" in func.attrs):
                continue
            sunk = relax.analysis.remove_all_unused(_Sinker(mod).visit_expr(func))
            if view_count(sunk) < view_count(func):
                updates[gvar] = sunk
                continue
            # Only the views of conv and matmul results, kept with as many views but fewer right
            # after those: the epilogue fusions take the element-wise ops the views moved below.
            sunk = relax.analysis.remove_all_unused(_Sinker(mod, anchored_only=True).visit_expr(func))
            if view_count(sunk) <= view_count(func) and _views_of_anchors(sunk) < _views_of_anchors(func):
                updates[gvar] = sunk
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def view_count(func: relax.Function) -> int:
    """How many transposes, squeezes and expand_dims ``func`` calls."""
    wanted = {tvm.ir.Op.get(name) for name in VIEW_OPS}
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op in wanted:
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return len(found)


ANCHOR_OPS = ("relax.nn.conv2d", "relax.nn.conv2d_transpose", "relax.matmul")


def _views_of_anchors(func: relax.Function) -> int:
    """How many views read a conv's or a matmul's result directly."""
    var2val = relax.analysis.get_var2val(func)
    views, anchors = {tvm.ir.Op.get(name) for name in VIEW_OPS}, {tvm.ir.Op.get(name) for name in ANCHOR_OPS}
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op in views and expr.args:
            source = var2val.get(expr.args[0]) if isinstance(expr.args[0], relax.Var) else expr.args[0]
            if isinstance(source, relax.Call) and source.op in anchors:
                found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return len(found)


def tensor_rank(expr) -> int | None:
    ty = expr.ty
    return ty.ndim if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None


def _is_all_ones(expr) -> bool:
    """A tensor that broadcasts the same way in any layout: a scalar or all dims 1."""
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return tensor_rank(expr) == 0
    return all(isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1 for dim in shape.values)


def _view_of(call, source_rank: int | None) -> tuple | None:
    """``("permute", axes)`` or ``("squeeze", axis)`` (one axis) for a view this pass sinks,
    ``("expand", axis)`` for one it only cancels; None for anything else."""
    if not isinstance(call, relax.Call) or source_rank is None:
        return None
    if call.op == tvm.ir.Op.get("relax.permute_dims"):
        axes = call.attrs.axes
        return ("permute", tuple(range(source_rank - 1, -1, -1)) if axes is None else tuple(int(a) for a in axes))
    for op, kind, rank in (("relax.squeeze", "squeeze", source_rank), ("relax.expand_dims", "expand", source_rank + 1)):
        axis = call.attrs.axis if call.op == tvm.ir.Op.get(op) else None
        if axis is not None and len(axis) == 1:
            return (kind, int(axis[0]) % rank)
    return None


def _view_call(source: relax.Expr, view: tuple) -> relax.Call:
    kind, arg = view
    if kind == "permute":
        return relax.op.permute_dims(source, list(arg))
    return (relax.op.squeeze if kind == "squeeze" else relax.op.expand_dims)(source, [arg])


def _compose(inner: tuple, outer: tuple) -> tuple | None:
    """``outer(inner(x))`` as one view, ``("identity",)`` when they cancel, None when they do
    not combine."""
    if inner[0] == outer[0] == "permute":
        axes = tuple(inner[1][a] for a in outer[1])
        return ("identity",) if axes == tuple(range(len(axes))) else ("permute", axes)
    if inner[0] == "squeeze" and outer == ("expand", inner[1]):
        return ("identity",)
    return None


@mutator
class _Sinker(PyExprMutator):
    """One walk in binding order: ``viewed[var] = (source, view)`` for every variable that is a
    transpose or a unit-axis squeeze of ``source``, so an op reading only such variables (and
    constants) is re-emitted on the sources and followed by one view of its own."""

    def __init__(self, mod: tvm.IRModule, anchored_only: bool = False):
        super().__init__(mod)
        self.viewed: dict = {}
        # Sink only views of a conv's or matmul's result (and what they become further down).
        self.anchored_only = anchored_only
        self.anchors = {tvm.ir.Op.get(name) for name in ANCHOR_OPS}
        self.values: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.builder_.normalize(self.visit_expr(binding.value))
        view = _view_of(value, tensor_rank(value.args[0])) if isinstance(value, relax.Call) and value.args else None
        if view is not None and self.anchored_only and value.args[0] not in self.viewed:
            source = self.values.get(value.args[0])
            if not (isinstance(source, relax.Call) and source.op in self.anchors):
                view = None
        if view is not None:
            self._emit_view(binding.var, value.args[0], view)
            return
        sunk = self._sunk(value)
        if sunk is None:
            var = rebind(self.builder_, binding.var, value)
            self.values[var] = value
            self.set_var_remap(binding.var, var)
            return
        call, view = sunk
        source = self.builder_.emit(call, str(binding.var.name))
        self._emit_view(binding.var, source, view)

    def _emit_view(self, old: relax.Var, source: relax.Expr, view: tuple) -> None:
        """``old = view(source)``, composed with ``source``'s own view where they combine."""
        if source in self.viewed:
            inner, first = self.viewed[source]
            composed = _compose(first, view)
            if composed == ("identity",):  # met its inverse
                cancelled = inner if isinstance(old, relax.DataflowVar) else rebind(self.builder_, old, inner)
                self.set_var_remap(old, cancelled)
                return
            if composed is not None:
                source, view = inner, composed
        # A sunk op took the old name (that is the ONNX node it computes); its view is new.
        name = f"{old.name}{SUFFIX}" if isinstance(source, relax.Var) and source.name == old.name else str(old.name)
        var = rebind(self.builder_, old, _view_call(source, view), name)
        if view[0] != "expand":
            self.viewed[var] = (source, view)
        self.set_var_remap(old, var)

    def _sunk(self, call) -> tuple[relax.Call, tuple] | None:
        """``call`` on the sources of its viewed operands, and the view to apply after it; None
        when it is not an op that commutes with the view, or some operand cannot follow."""
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)):
            return None
        if call.op.name == "relax.strided_slice":
            return self._sunk_slice(call)
        if call.op.name == "relax.concat":
            return self._sunk_concat(call)
        if call.op.name not in ELEMENTWISE_OPS:
            return None
        view = next((self.viewed[arg][1] for arg in call.args if arg in self.viewed), None)
        if view is None or tensor_rank(call) is None or view[0] == "permute" and tensor_rank(call) != len(view[1]):
            return None
        source_rank = tensor_rank(call) + (view[0] == "squeeze")
        args = []
        for arg in call.args:
            if arg in self.viewed:
                source, arg_view = self.viewed[arg]
                if arg_view != view or tensor_rank(arg) != tensor_rank(call):
                    return None
                args.append(source)
            elif isinstance(arg, tvm.ir.GenericConst):
                args.append(_constant_for_source(arg, view, source_rank))
            elif not isinstance(arg.ty, relax.TensorType) or _is_all_ones(arg):
                args.append(arg)
            elif tensor_rank(arg) == tensor_rank(call):
                # A tensor in the view's layout (a residual from before the view): laid out
                # back with the inverse view, kept only where the function ends up with fewer.
                args.append(self.builder_.emit(_view_call(arg, _inverse(view, source_rank))))
            else:
                return None
        return relax.Call(call.op, args, call.attrs, call.ty_args), view

    def _sunk_slice(self, call) -> tuple[relax.Call, tuple] | None:
        """A slice of a squeezed row is the same slice of its source, on the source's axes.
        Transposes are not carried through slices and concats: the attention patterns read a
        head transpose where the exporter put it, before the rotary embedding's halves."""
        data, axes = call.args[0], int_tuple(call.args[1])
        if data not in self.viewed or axes is None or self.viewed[data][1][0] != "squeeze":
            return None
        source, view = self.viewed[data]
        sliced = relax.op.strided_slice(source, [_source_axis(view, axis % tensor_rank(data)) for axis in axes],
                                        *call.args[2:], assume_inbound=bool(call.attrs.assume_inbound))
        return sliced, view

    def _sunk_concat(self, call) -> tuple[relax.Call, tuple] | None:
        """A concat of rows squeezed alike (circular padding: a row between two of its own
        slices) is the concat of their sources, along the source's axis."""
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple) or not all(part in self.viewed for part in parts.fields):
            return None
        views = {self.viewed[part][1] for part in parts.fields}
        if len(views) != 1 or next(iter(views))[0] != "squeeze":
            return None
        (view,) = views
        axis = _source_axis(view, int(call.attrs.axis) % tensor_rank(call))
        return relax.op.concat([self.viewed[part][0] for part in parts.fields], axis), view


def int_tuple(values: relax.Expr) -> list[int] | None:
    """The ints of a tuple of constants (a slice's axes, begin or end); None when one is not."""
    try:
        return [int(field.value) for field in values.fields]
    except (AttributeError, TypeError):
        return None


def _source_axis(view: tuple, axis: int) -> int:
    """The axis of a view's source that is ``axis`` of the view."""
    if view[0] == "permute":
        return view[1][axis]
    return axis + (axis >= view[1])  # squeeze: the axes from the squeezed one on move up


def _inverse(view: tuple, source_rank: int) -> tuple:
    """The view that takes a tensor in the view's layout back to the source's."""
    if view[0] == "permute":
        return ("permute", tuple(int(a) for a in np.argsort(view[1])))
    assert source_rank > view[1]
    return ("expand", view[1])


def _constant_for_source(constant: tvm.ir.GenericConst, view: tuple, source_rank: int) -> tvm.ir.GenericConst:
    """The constant that broadcasts against the view's source as ``constant`` did against the
    view: padded with leading 1s to the view's rank, then laid out back (permuted by the
    inverse axes, or given the squeezed axis back)."""
    value = constant.value.numpy()
    if value.ndim == 0:
        return constant
    if view[0] == "permute":
        value = value.reshape((1,) * (source_rank - value.ndim) + value.shape)
        value = np.transpose(value, np.argsort(view[1]))
    else:
        value = np.expand_dims(value.reshape((1,) * (source_rank - 1 - value.ndim) + value.shape), view[1])
    return relax.const(np.ascontiguousarray(value), str(value.dtype))
