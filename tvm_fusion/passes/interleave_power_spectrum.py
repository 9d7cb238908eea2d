"""InterleavePowerSpectrum: ``re^2 + im^2`` of a matmul's two column halves, read from interleaved columns.

An STFT front end computes its power spectrum from one product: the real and imaginary DFT
filters side by side (one conv of ``2n`` filters, silero VAD's ``forward_basis``; two sibling
convs after ``MergeSiblingConvs``), a matmul of the signal's frames after
``StridedRowConvAsMatmul``. Then ``re = C[..., :n]`` and ``im = C[..., n:]``, and the power
``re^2 + im^2`` pairs column ``j`` with column ``j + n``: never in one output tile, so the
matmul writes all of ``C`` and a kernel of its own reads it back for the power (openWakeWord's
melspectrogram: 1.4 us of its 29).

With the filters interleaved at build time (column ``2j`` the real filter ``j``, ``2j + 1`` its
imaginary one) the pair sits side by side, ``re`` and ``im`` are the even and odd columns, and
the power is computed in the matmul's kernel (``patterns/power_spectrum.py`` fuses it). Each
value is the same sum of the same products (only the columns moved), squared and added in the
same order (a square as ``x * x``, which is what LLVM makes of ``pow(x, 2)``).

Taken where both halves come from one matmul by a constant ``[K, 2n]`` weight through views
(transposes, unit axes) and one slice each on the weight's column axis, each squared (``x * x``
or ``x ** 2``), their views alike, and nothing else reads the matmul or those steps. The views
are applied to the power instead, composed with those that follow it into one (a reshape where
the element order holds); element-wise steps by scalars after the power (a magnitude's square
root) come before those views, so that the fusion takes them as its tail.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..patterns import PatternReport
from ..patterns.base import scalar_constant, static_shape, strided_slice_fields
from .rebinding import mutate_functions, readers_of, rebind
from .sink_views import ELEMENTWISE_OPS

PASS_NAME = "interleave_power_spectrum"
_VIEWS = ("relax.permute_dims", "relax.expand_dims", "relax.squeeze")


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.InterleavePowerSpectrum")
class InterleavePowerSpectrum:
    def __init__(self, report: PatternReport | None = None):
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        report = PatternReport()
        rewritten = mutate_functions(mod, lambda module: _Rewriter(module, report))
        if not report.variants:
            return mod
        if self.report is not None:
            self.report.variants.update(report.variants)
        return relax.transform.DeadCodeElimination()(rewritten)


def _op(value) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


def squared(value) -> relax.Expr | None:
    """``x`` of ``x * x`` or ``x ** 2``, else None."""
    if _op(value) == "relax.multiply" and value.args[0].same_as(value.args[1]):
        return value.args[0]
    if _op(value) == "relax.power" and scalar_constant(value.args[1]) == 2.0:
        return value.args[0]
    return None


def _column_axis(view: relax.Call, axis: int, rank: int) -> int | None:
    """Where ``axis`` of a rank-``rank`` input lands in ``view``'s result (None: squeezed away)."""
    name = _op(view)
    if name == "relax.permute_dims":
        order = list(range(rank))[::-1] if view.attrs.axes is None else [int(a) % rank for a in view.attrs.axes]
        return order.index(axis)
    if name == "relax.expand_dims":
        out_rank = rank + len(view.attrs.axis)
        new = sorted(int(a) % out_rank for a in view.attrs.axis)
        kept = [i for i in range(out_rank) if i not in new]
        return kept[axis]
    squeezed = (list(range(rank)) if view.attrs.axis is None else [int(a) % rank for a in view.attrs.axis])
    return None if axis in squeezed else axis - sum(1 for a in squeezed if a < axis)


class _Half:
    """One squared operand traced back to its matmul: the views before and after its slice, the
    slice's column range, and every variable on the way."""

    def __init__(self):
        self.before: list[relax.Call] = []  # views between the matmul and the slice, first first
        self.after: list[relax.Call] = []  # views between the slice and the square
        self.range: tuple[int, int] | None = None
        self.matmul: relax.Var | None = None
        self.sliced: relax.Var | None = None  # the slice's variable (a merged sibling conv's own)
        self.square: relax.Var | None = None
        self.vars: list[relax.Var] = []


def trace_half(var, bindings: dict) -> _Half | None:
    """``var`` as views of one slice of a matmul's columns by a constant weight, or None."""
    half, chain = _Half(), []
    while isinstance(var, relax.Var) and var in bindings:
        half.vars.append(var)
        value = bindings[var]
        if _op(value) == "relax.matmul":
            half.matmul = var
            break
        if _op(value) not in (*_VIEWS, "relax.strided_slice"):
            return None
        if _op(value) == "relax.strided_slice":
            half.sliced = var
        chain.append(value)
        var = value.args[0]
    if half.matmul is None:
        return None
    chain.reverse()  # matmul first
    rank = len(static_shape(half.matmul) or ())
    axis = rank - 1
    for step in chain:
        if _op(step) == "relax.strided_slice":
            if half.range is not None:
                return None
            half.range = column_range(step, axis)
            if half.range is None:
                return None
        else:
            (half.after if half.range is not None else half.before).append(step)
            axis = _column_axis(step, axis, rank)
            if axis is None:
                return None
        rank = len(static_shape(step) or ())
    return half if half.range is not None else None


def column_range(step: relax.Call, axis: int) -> tuple[int, int] | None:
    """The range of ``axis`` a strided_slice takes, in steps of 1, when it takes every other axis
    whole (as exporters spell it: silero's slice names all axes, ends past the extent); else None."""
    shape, fields = static_shape(step.args[0]), strided_slice_fields(step)
    if shape is None or fields is None:
        return None
    axes, begin, end, strides = fields
    taken = None
    for ax, first, last, stride in zip(axes, begin, end, strides):
        ax, size = ax % len(shape), shape[ax % len(shape)]
        first, last = (min(max(v + size if v < 0 else v, 0), size) for v in (first, last))
        if stride != 1:
            return None
        if ax == axis:
            taken = (first, last)
        elif (first, last) != (0, size):
            return None
    return taken


def spectrum_halves(add: relax.Call, bindings: dict, readers: dict) -> tuple[_Half, _Half, np.ndarray] | None:
    """(real half, imaginary half, the ``[K, 2n]`` weight) of ``add`` when it is the power of one
    matmul's column halves that nothing else reads (``readers``: ``readers_of`` the block); None
    otherwise."""
    if _op(add) != "relax.add":
        return None
    squares = [bindings.get(arg) for arg in add.args]
    operands = [squared(value) for value in squares]
    if any(operand is None for operand in operands):
        return None
    halves = [trace_half(operand, bindings) for operand in operands]
    if any(half is None for half in halves) or not halves[0].matmul.same_as(halves[1].matmul):
        return None
    for half, square in zip(halves, add.args):
        half.square = square
    weight = bindings[halves[0].matmul].args[1]
    if not isinstance(weight, tvm.ir.GenericConst) or weight.ty.ndim != 2:
        return None
    columns = int(weight.ty.shape[1])
    real, imaginary = sorted(halves, key=lambda half: half.range)
    if columns % 2 or real.range != (0, columns // 2) or imaginary.range != (columns // 2, columns):
        return None
    if not (_same_views(real.before, imaginary.before) and _same_views(real.after, imaginary.after)):
        return None
    steps = [*real.vars, *imaginary.vars, *add.args]
    chain = [bindings[var] for var in steps] + [add]
    for var in steps:
        if not isinstance(var, relax.DataflowVar) or not all(
                any(reader.value.same_as(step) for step in chain) for reader in readers.get(var, ())):
            return None  # read outside the power, or a graph output
    return real, imaginary, weight.value.numpy()


def _same_views(first: list[relax.Call], second: list[relax.Call]) -> bool:
    return len(first) == len(second) and all(
        a.op.same_as(b.op) and tvm_ffi.structural_equal(a.attrs, b.attrs) for a, b in zip(first, second))


def interleaved(weight: np.ndarray) -> np.ndarray:
    """Columns ``[re_0, im_0, re_1, im_1, ...]`` of ``[re_0..re_n-1, im_0..im_n-1]``."""
    half = weight.shape[1] // 2
    return np.stack([weight[:, :half], weight[:, half:]], axis=2).reshape(weight.shape[0], -1)


def composed_views(shape: tuple[int, ...], views: list[relax.Call]) -> tuple[list[int] | None, tuple[int, ...]]:
    """``views`` applied in turn to a tensor of ``shape`` as one transpose of its non-unit axes
    (None: the order is kept, so the chain is a reshape, which moves no data) and the result's
    shape."""
    index = np.arange(int(np.prod(shape))).reshape(shape)
    strides = index.strides
    for view in views:
        name = _op(view)
        if name == "relax.permute_dims":
            index = np.transpose(index, None if view.attrs.axes is None else [int(a) for a in view.attrs.axes])
        elif name == "relax.expand_dims":
            index = np.expand_dims(index, tuple(int(a) for a in view.attrs.axis))
        else:
            index = np.squeeze(index, None if view.attrs.axis is None else tuple(int(a) for a in view.attrs.axis))
    kept = [axis for axis, size in enumerate(shape) if size != 1]
    order = sorted(kept, key=lambda axis: -strides[axis])  # outermost first
    # The position, among the non-unit source axes, that each non-unit result axis walks.
    walked = [order.index(next(axis for axis in kept if index.strides[position] == strides[axis]))
              for position, size in enumerate(index.shape) if size != 1]
    return (None if walked == sorted(walked) else walked), tuple(index.shape)


def _by_element(step: relax.Expr, var: relax.Var) -> bool:
    """Whether ``step`` computes each element of ``var`` alone: an element-wise op with ``var``
    first and only scalar constants after it."""
    return (_op(step) in ELEMENTWISE_OPS and step.args[0].same_as(var) and all(
        isinstance(arg, relax.PrimValue) or isinstance(arg, tvm.ir.GenericConst) and arg.ty.ndim == 0
        for arg in step.args[1:]))


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, report: PatternReport):
        super().__init__(mod)
        self.report = report
        self.bindings: dict = {}
        self.readers: dict = {}
        self.block: list = []
        self.replaced: dict = {}  # variable -> its new value; None: dropped (read only by what is replaced)

    def visit_dataflow_block_(self, block):
        self.block = list(block.bindings)
        self.readers = readers_of(self.block)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bindings[binding.var] = binding.value
        if binding.var in self.replaced:
            value = self.replaced[binding.var]
            if value is not None:
                self.set_var_remap(binding.var, rebind(self.builder_, binding.var, value))
            return
        found = spectrum_halves(binding.value, self.bindings, self.readers)
        if found is None:
            self.set_var_remap(binding.var, rebind(self.builder_, binding.var, self.visit_expr(binding.value)))
            return
        self.report.variants[f"{PASS_NAME}.matmul"] += 1
        real, imaginary, weight = found
        power = self._interleaved_power(self.bindings[real.matmul], weight, real, imaginary)
        views, last = [*real.before, *real.after], binding.var
        # What reads the power alone, step by step: views are composed with its own; a step by
        # element (a magnitude's square root, a log) commutes with them and comes first.
        elementwise = []
        while len(self.readers.get(last, ())) == 1:
            step = self.readers[last][0].value
            if _op(step) in _VIEWS:
                views.append(step)
            elif _by_element(step, last):
                elementwise.append(step)
            else:
                break
            self.replaced[last] = None
            last = self._bound_to(step)
        if elementwise:
            power = self.builder_.emit(power, str(binding.var.name))
            for step in elementwise[:-1]:
                power = self.builder_.emit(relax.Call(step.op, [power, *step.args[1:]], step.attrs))
            power = self.builder_.normalize(relax.Call(elementwise[-1].op, [power, *elementwise[-1].args[1:]],
                                                       elementwise[-1].attrs))
        shape_before = tuple(int(d) for d in power.ty.shape)
        transpose, shape = composed_views(shape_before, views)
        if transpose is None and shape == shape_before:
            self.replaced[last] = power
        elif transpose is None:
            self.replaced[last] = relax.op.reshape(self.builder_.emit(power, str(binding.var.name)), shape)
        else:  # replayed as they were, for SinkViews to push past what follows
            power = self.builder_.emit(power, str(binding.var.name))
            for view in views[:-1]:
                power = self.builder_.emit(relax.Call(view.op, [power], view.attrs))
            self.replaced[last] = relax.Call(views[-1].op, [power], views[-1].attrs)
        if last.same_as(binding.var):
            self.set_var_remap(binding.var, rebind(self.builder_, binding.var, self.replaced.pop(last)))

    def _interleaved_power(self, matmul: relax.Call, weight: np.ndarray, real: _Half, imaginary: _Half) -> relax.Call:
        """``re^2 + im^2`` of the matmul by the interleaved weight (its even and odd columns), the
        sum not yet bound; each step bound is named as the step it replaces, so that it traces
        back to the same ONNX nodes."""
        emit = self.builder_.emit
        product = emit(relax.op.matmul(self.visit_expr(matmul.args[0]), relax.const(interleaved(weight)),
                                       out_dtype=matmul.attrs.out_dtype), str(real.matmul.name))
        last, columns = matmul.ty.ndim - 1, int(weight.shape[1])
        squares = []
        for start, half in enumerate((real, imaginary)):
            part = emit(relax.op.strided_slice(product, [last], [start], [columns], [2], assume_inbound=True),
                        str(half.sliced.name))
            squares.append(emit(relax.op.multiply(part, part), str(half.square.name)))
        return self.builder_.normalize(relax.op.add(*squares))

    def _bound_to(self, call: relax.Call) -> relax.Var:
        return next(binding.var for binding in self.block if binding.value.same_as(call))
