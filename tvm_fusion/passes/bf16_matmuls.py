"""Bf16Matmuls: matmuls and dense convs by constant float32 weights as bf16 kernels with float32 sums.

``--precision bf16`` (issue 43): each ``x @ W`` with ``W`` a 2-D float32 constant, and each
``x @ permute_dims(W)`` (an ONNX Gemm with ``transB=1``), becomes the kernel of
``frontend/bf16_matmul.py``: the weight rounded to bf16 and packed at build time, the
activation rounded to bf16 in the kernel's prologue, the products summed in float32. Each
dense ``conv2d`` by a constant (NCHW or the blocked layout, any stride, dilation and padding)
becomes the same sum over its input's patches (``frontend/bf16_conv.py``); a grouped or
depthwise conv, one of a blocked input of fewer than 16 channels (8 strided along its columns)
or of a one-channel NCHW input, a conv on a pooled map (``conv_geometry`` says why), one of fewer
than ``MIN_CONV_MACS`` multiply-adds or fewer than ``MIN_CONV_OUT_CHANNELS`` output channels, and on a target without
AMX one that float32 computes by Winograd
(``keeps_winograd_convs``) stays float32. What feeds and follows them stays float32.

It runs in the "lower" phase before LegalizeOps, so that FuseOps puts the float32 epilogue
(bias, activation, residual add) into the same kernel. By then our fusion patterns have made
composite functions whose weight is a parameter (``FuseOpsByPattern(bind_constants=False)``),
one composite for all the layers that share a shape: a matmul in a composite whose weight
parameter is a constant at every call and read by that matmul alone is rewritten too; the
composite then takes a packed bf16 weight in that parameter's place, each call its own.

Declines (the module unchanged) on a target with neither AMX-BF16 nor AVX512_BF16
(``has_bf16_kernels``; the target given, else the current one; with neither, no rewrite): there
the kernel would run as float32 FMAs on widened bf16 loads under the generic rules, slower than
the float32 kernels. Declines too for a weight that is not a float32 constant
(``bf16_matmul_declines`` says why for each matmul), or a row count that is not static
(the AMX tiles need one: ``_static_rows``).

``declined``: the matmul and conv bindings to leave float32, those compile's bf16 gate keeps
float32 (``commands/bf16_kernels.py``), each by its ``Bf16Candidate.key``: the binding's name
(``onnx<node>_<k>``, kept inside composites) in ``main``, and ``NAME#k`` for the k-th call of the
composite that holds it. A composite some of whose calls are declined is kept beside its
rewrite, and those calls keep calling it: one composite serves every layer of a shape, and the
gate finds one layer of them, not all. ``bf16_candidates`` lists what the pass would rewrite,
one per call, with the activation each one reads (a conv's: its patch rows), for that gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from ..frontend.bf16_conv import emit_bf16_conv2d
from ..frontend.bf16_matmul import bf16_matmul_declines, emit_bf16_matmul, pack_weight, packed_weight_shape
from ..frontend.conv_geometry import (TILE_ROW_BYTES, ConvGeometry, conv_geometry, oihw_weight, patch_rows,
                                      weight_matrix)
from ..frontend.packed_weights import COLUMN_BLOCK, REGISTER_TILE_ROWS
from ..kernels.cpu_features import has_amx_bf16, has_bf16_kernels
from .blocked_layout_legalize import winograd_tile_of
from .rebinding import rebind, vars_in

MATMUL, PERMUTE_DIMS, CONV2D = "relax.matmul", "relax.permute_dims", "relax.nn.conv2d"
# Multiply-adds a conv needs to run faster as bf16 patches on tiles than as float32 FMAs: below
# it the input's rounding, the patches and each call's set-up cost more than the tiles save
# (the convs of 0.15-0.6M multiply-adds of two PP-OCR models ran 1.1-1.7x slower, kernel alone).
# Past it the gain depends on the shape (1.2x slower to 0.24x); matmuls gain from 0.6M.
MIN_CONV_MACS = 1 << 20
# Output channels a conv needs: its tiles compute a column block of 16 (the padding's weights zero),
# so 8 take half of each tile's work; fewer, the float32 kernel is faster.
MIN_CONV_OUT_CHANNELS = COLUMN_BLOCK // 2
# k per AMX A-tile row of bf16: a conv whose channels fill whole rows has its tiles read its input directly.
BF16_TILE_ROW_DEPTH = TILE_ROW_BYTES // 2


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Bf16Matmuls")
class Bf16Matmuls:
    """Matmuls by constant float32 weights as bf16 x bf16 -> float32 kernels (``target``
    None: the current target); the matmuls named in ``declined`` stay float32, and with
    ``winograd`` (the config's: float32 3x3 convs by Winograd) so do such convs where
    ``keeps_winograd_convs``."""

    def __init__(self, target: Target | None = None, declined: frozenset[str] = frozenset(), winograd: bool = True):
        self.target, self.declined, self.winograd = target, frozenset(declined), winograd

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or Target.current(allow_none=True)
        if target is None or not has_bf16_kernels(target):
            return mod
        rewriter = _Rewriter(mod, self.declined, keep_winograd=self.winograd and keeps_winograd_convs(target),
                             row_multiple=1 if has_amx_bf16(target) else REGISTER_TILE_ROWS,
                             tile_row_depth=_tile_row_depth(target))
        functions = _rewrite_functions(mod, rewriter)
        if not rewriter.changed:
            return mod
        built = rewriter.builder_.get()  # with the kernels' PrimFuncs and the rewritten composites
        kept = {gvar: func for gvar, func in built.functions_items()
                if gvar not in rewriter.replaced or rewriter.float32_calls[gvar]}
        kept.update({gvar: func for gvar, func in functions.items() if gvar not in rewriter.replaced})
        return relax.transform.Normalize()(tvm.IRModule(kept, mod.attrs, mod.global_infos))


@dataclasses.dataclass
class Bf16Candidate:
    """A matmul ``Bf16Matmuls`` would rewrite: its binding's name, its ``[K, N]`` weight, the
    activation it reads as an expression of ``main`` (None where a composite computes it itself),
    and for a conv its geometry (the activation's patch rows are what multiply the weight)."""

    name: str
    weight: np.ndarray
    activation: relax.Expr | None
    conv: ConvGeometry | None = None
    call: int | None = None  # which call of its composite; None in main, or for a weight every call shares

    @property
    def key(self) -> str:
        """What ``Bf16Matmuls(declined=...)`` names it by: one call of a composite, or a binding of main."""
        return self.name if self.call is None else f"{self.name}#{self.call}"

    def rows(self, activation: np.ndarray) -> np.ndarray:
        """The rows that multiply ``weight``, of the activation the model gave."""
        return activation if self.conv is None else patch_rows(activation, self.conv)


def keeps_winograd_convs(target: Target) -> bool:
    """Whether a 3x3 conv that float32 computes by Winograd stays float32: on ``vdpbf16ps``
    registers (AVX512_BF16 without AMX-BF16), whose peak is under twice the FMAs', the direct
    bf16 conv does 2.25-4x the multiply-adds of Winograd's; on AMX tiles it is far faster."""
    return not has_amx_bf16(target)


def _tile_row_depth(target: Target) -> int:
    """The k of an A-tile row whose convs' tiles may read their input directly: AMX's, 0 without it."""
    return BF16_TILE_ROW_DEPTH if has_amx_bf16(target) else 0


def bf16_candidates(mod: tvm.IRModule, target: Target, winograd: bool = True) -> list[Bf16Candidate]:
    """The matmuls ``Bf16Matmuls(target, winograd=winograd)`` rewrites in ``mod``, ``mod`` unchanged."""
    rewriter = _Rewriter(mod, frozenset(), candidates=[], keep_winograd=winograd and keeps_winograd_convs(target),
                         tile_row_depth=_tile_row_depth(target))
    _rewrite_functions(mod, rewriter)
    return rewriter.candidates


def _rewrite_functions(mod: tvm.IRModule, rewriter: _Rewriter) -> dict:
    composites = [(g, f) for g, f in mod.functions_items() if _is_composite(f)]
    callers = [(g, f) for g, f in mod.functions_items() if isinstance(f, relax.Function) and not _is_composite(f)]
    # composites first: their callers pass what they now take
    return {gvar: rewriter.rewrite(gvar, func) for gvar, func in composites + callers}


def _is_composite(func) -> bool:
    return isinstance(func, relax.Function) and bool(func.attrs) and "Composite" in func.attrs


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


@dataclasses.dataclass(frozen=True)
class _Product:
    """A matmul or conv the bf16 kernels can compute: the weight as the op reads it (a constant
    or a composite's parameter), whether it is read through a transpose, how a float32 value of
    it becomes the ``[K, N]`` matrix the kernel multiplies, and a conv's geometry."""

    weight: relax.Expr
    transposed: bool
    matrix: Callable[[np.ndarray], np.ndarray]
    conv: ConvGeometry | None = None


def _product_of(value: relax.Expr, bindings: dict, tile_row_depth: int = 0) -> _Product | None:
    """``matmul(x, W)``, ``matmul(x, permute_dims(W))`` (an ONNX Gemm with ``transB=1``) or a
    dense float32 ``conv2d(x, W)`` (``conv_geometry``, with the A-tile row depth of the AMX
    tiles that may read its input directly, 0 without them); None for any other value."""
    if _is_op(value, CONV2D):
        geometry = conv_geometry(value, tile_row_depth)
        if isinstance(geometry, str) or geometry.pixels * geometry.depth * geometry.out_channels < MIN_CONV_MACS:
            return None
        layout = str(value.attrs.kernel_layout)
        return _Product(value.args[1], False, lambda w: weight_matrix(oihw_weight(w, layout), geometry), geometry)
    if not _is_op(value, MATMUL) or value.attrs.out_dtype not in (None, "", "void", "float32"):
        return None
    weight = bindings.get(value.args[1], value.args[1])
    if _is_op(weight, PERMUTE_DIMS) and weight.args[0].ty.ndim == 2 and (
            weight.attrs.axes is None or [int(a) for a in weight.attrs.axes] == [1, 0]):
        return _Product(weight.args[0], True, lambda w: np.ascontiguousarray(w.T))
    return _Product(value.args[1], False, lambda w: w)


def _static_rows(data: relax.Expr) -> bool:
    """Whether the activation's leading axes are static: the AMX tiles need a known row count,
    and the kernel without them is far slower than float32's (``frontend/bf16_matmul.py``)."""
    return all(isinstance(d, tvm.tirx.IntImm) for d in data.ty.shape.values[:-1])


def _calls(mod: tvm.IRModule) -> dict:
    """Function GlobalVar -> its calls in the module."""
    calls: dict = {}
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: calls.setdefault(e.op, []).append(e) if isinstance(
                e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar) else None)
    return calls


def _uses(func: relax.Function) -> dict:
    """Variable -> how many bindings (and the function's result) read it."""
    counts: dict = {}
    reads = [binding.value for block in func.body.blocks for binding in block.bindings] + [func.body.body]
    for value in reads:
        for var in vars_in(value):
            counts[var] = counts.get(var, 0) + 1
    return counts


@mutator
class _Rewriter(PyExprMutator):
    """One builder for the whole module: the kernels' PrimFuncs and the rewritten composites
    are added to it as it goes (``rewrite`` per function, composites first)."""

    def __init__(self, mod: tvm.IRModule, declined: frozenset[str], candidates: list | None = None,
                 keep_winograd: bool = False, row_multiple: int = 1, tile_row_depth: int = 0):
        super().__init__(mod)
        self.declined = declined
        self.keep_winograd = keep_winograd  # convs that float32 computes by Winograd stay float32
        self.row_multiple = row_multiple  # a matmul's rows padded to a multiple of the register tiles
        self.tile_row_depth = tile_row_depth  # a conv's geometry: where AMX tiles may read its input directly
        self.candidates = candidates  # a list: record each matmul it would rewrite, rewrite none
        self.calls = _calls(mod)
        self.changed = False
        self.packed_arguments: dict = {}  # composite GlobalVar -> {parameter index: its constant -> [K, N]}
        self.replaced: dict = {}  # a rewritten composite's GlobalVar -> the new one (its type changed)
        self.float32_calls: dict = {}  # a rewritten composite's GlobalVar -> the calls that keep it

    def rewrite(self, gvar: tvm.ir.GlobalVar, func: relax.Function) -> relax.Function:
        """``func`` with its matmuls by constant weights as bf16 kernels, and its calls of
        rewritten composites passing their packed weights."""
        self.bindings: dict = {}
        self.uses = _uses(func)
        calls = self.calls.get(gvar, []) if _is_composite(func) else []
        # a composite's parameters -> their arguments, at each of its calls; None in main
        self.arguments = [dict(zip(func.params, call.args)) for call in calls] if _is_composite(func) else None
        # the parameters that are a constant at every call -> those constants, a call's each
        self.param_constants = {param: [arguments[param] for arguments in self.arguments] for param in func.params
                                if self.arguments and all(isinstance(arguments[param], tvm.ir.GenericConst)
                                                          for arguments in self.arguments)}
        self.packed_params: dict = {}  # float32 weight parameter -> its packed bf16 replacement
        self.packed_matrix: dict = {}  # float32 weight parameter -> its constant -> the [K, N] matrix
        self.declined_calls: set[int] = set()  # this composite's calls that stay float32
        self.rewrote = False
        new = self.visit_expr(func)
        if self.rewrote:
            new = relax.analysis.remove_all_unused(new)  # the transposes the kernels no longer read
        if self.packed_params:
            params = [self.packed_params.get(p, p) for p in func.params]
            new = relax.Function(params, new.body, new.ret_ty, new.is_pure, new.attrs)
            self.packed_arguments[gvar] = {i: self.packed_matrix[p] for i, p in enumerate(func.params)
                                           if p in self.packed_params}
            self.replaced[gvar] = self.builder_.add_func(new, gvar.name_hint)
            self.float32_calls[gvar] = [calls[k] for k in sorted(self.declined_calls)]
        return new

    def _conv_stays_float32(self, conv: relax.Call, geometry: ConvGeometry) -> bool:
        """A conv of fewer than ``MIN_CONV_OUT_CHANNELS`` (a spectrogram's one-channel head: 16
        columns computed for each one kept), and with ``keep_winograd`` one that float32
        computes by Winograd."""
        return geometry.out_channels < MIN_CONV_OUT_CHANNELS or (self.keep_winograd and bool(winograd_tile_of(conv)))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        original = call
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.GlobalVar) and call.op in self.replaced):
            return call
        if any(original.same_as(kept) for kept in self.float32_calls[call.op]):
            return call  # a declined call: the float32 composite, kept beside its rewrite
        packed = self.packed_arguments[call.op]  # each call packs its own weight
        args = [arg if i not in packed else relax.const(tvm.runtime.tensor(pack_weight(packed[i](arg.value.numpy()))))
                for i, arg in enumerate(call.args)]
        return relax.Call(self.replaced[call.op], args, call.attrs, call.ty_args)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bindings[binding.var] = binding.value
        value = self.visit_expr(binding.value)
        replaced = None if binding.var.name in self.declined else self._bf16(binding.var, binding.value, value)
        if replaced is not None and isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, replaced)  # no alias binding: FuseOps does not fuse through one
        else:
            self.set_var_remap(binding.var, rebind(self.builder_, binding.var, value if replaced is None else replaced))

    def _bf16(self, var: relax.Var, original: relax.Expr, value: relax.Expr) -> relax.Expr | None:
        product = _product_of(original, self.bindings, self.tile_row_depth)
        if product is None or (product.conv is not None and self._conv_stays_float32(original, product.conv)):
            return None
        weight_expr = product.weight
        is_param = weight_expr in self.param_constants
        if is_param and (self.uses.get(weight_expr) != 1 or (product.transposed and self.uses.get(original.args[1]) != 1)):
            return None  # the parameter (or its transpose) is read elsewhere too: it must stay float32
        constants = self.param_constants[weight_expr] if is_param else [weight_expr]
        if not isinstance(constants[0], tvm.ir.GenericConst):
            return None
        declined = {k for k in range(len(constants)) if f"{var.name}#{k}" in self.declined} if is_param else set()
        if len(declined) == len(constants):
            return None
        weight = product.matrix(constants[0].value.numpy())  # every call's has this shape and dtype
        if product.conv is None and (bf16_matmul_declines(value.args[0], weight) is not None
                                     or not _static_rows(value.args[0])):
            return None
        if self.candidates is not None:  # one per call: each its own weight and activation
            data = original.args[0]
            for index, constant in enumerate(constants):
                activation = data if self.arguments is None else self.arguments[index].get(data)
                self.candidates.append(Bf16Candidate(var.name, product.matrix(constant.value.numpy()), activation,
                                                     product.conv, index if is_param else None))
            return None
        self.declined_calls |= declined
        packed = None
        if is_param:  # the composite's callers pass their packed weights in this parameter's place
            packed = relax.Var(f"{weight_expr.name}_bf16", relax.TensorType(packed_weight_shape(weight.shape), "uint16"))
            self.packed_params[weight_expr] = packed
            self.packed_matrix[weight_expr] = product.matrix
        self.changed = self.rewrote = True
        if product.conv is not None:
            # Register tiles take row_multiple rows: an output row that many divide keeps its
            # tiles, and the epilogue after each, within it.
            conv = product.conv if self.row_multiple == 1 else dataclasses.replace(
                product.conv, min_tile_rows=self.row_multiple)
            return emit_bf16_conv2d(self.builder_, value.args[0], conv, weight, packed, var.name)
        return emit_bf16_matmul(self.builder_, value.args[0], weight, packed, var.name, self.row_multiple)
