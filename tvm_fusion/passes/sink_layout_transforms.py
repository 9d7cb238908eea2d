"""Layout transforms back to NCHW sunk below resizes, concats, slices, pools and element-wise
ops, to meet the transform that undoes them.

TVM's layout inference carries NCHW[x]c through element-wise ops and pools but not through
``image.resize2d`` (it falls back to NCHW for a blocked input), ``strided_slice`` (on channels,
or on rows and columns: a circular pad written as Slice + Concat), nor then through the concat
after them; a channel ``split`` it gets wrong outright (a slice
of 0 channels, and the inference fails). An FPN's top-down merge, ``concat(resize(p5), p4)``
between blocked convs, thus costs three transforms: p5 and p4 to NCHW, the merged map back;
a YOLOv8 C2f block (split the channels in two, convs on one half, concat) as many. ``clip`` it
sends back to NCHW too (every HardSwish and HardSigmoid of a mobile network), and a [1]-shaped
scale, an SE block's global pool and ``map * gate``, and some pools. These ops
work on the blocked layout as they are (topi's resize takes ``NCHW{x}c``; a concat or a slice
of whole channel blocks is one of blocks, an element-wise op of a map and scalars any layout),
so each ``op(to_nchw(a), ...)`` becomes
``to_nchw(op(a, ...))``, and where the transform meets its inverse the two cancel. Channel
splits are first spelled as slices (``split_channels_as_slices``), which the inference
handles by falling back to NCHW.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym.analyzer import Analyzer

from ..patterns.base import static_shape
from .pad_conv_channels import QUANTIZATION_OPS, global_pool
from .rebinding import rebind
from .sink_views import ELEMENTWISE_OPS, int_tuple, tensor_rank


def sink_transforms_to_nchw(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its blocked-to-NCHW transforms sunk below resizes and channel concats,
    kept for a function only when fewer transforms are left."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or (func.attrs and "Composite" in func.attrs):
            continue
        sunk = relax.analysis.remove_all_unused(_TransformSinker(mod).visit_expr(func))
        if transform_count(sunk) < transform_count(func):
            mod[gvar] = sunk
    return mod


def split_channels_as_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """Every split of a 4-D map along its channels as one ``strided_slice`` per part (a new
    module: the caller keeps the old one)."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            mod[gvar] = relax.analysis.remove_all_unused(_SplitAsSlices(mod).visit_expr(func))
    return mod


def transform_count(func: relax.Function) -> int:
    found = []
    op = tvm.ir.Op.get("relax.layout_transform")
    relax.analysis.post_order_visit(
        func.body, lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == op else None)
    return len(found)


def to_nchw(data: relax.Expr, block: int) -> relax.Call:
    return relax.op.layout_transform(data, lambda n, c, h, w, b: [n, c * block + b, h, w])


def _maps(call: relax.Call, probe: list[int], expected: list[int]) -> bool:
    analyzer = Analyzer()
    mapped = call.attrs.index_map.map_indices([tvm.tirx.IntImm("int64", i) for i in probe])
    return [int(analyzer.simplify(i)) for i in mapped] == expected


def _transform_kind(call) -> tuple[str, int] | None:
    """``("to_nchw", x)`` for a transform NCHW{x}c -> NCHW, ``("to_blocked", x)`` for its
    inverse (no padding), None for anything else."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.layout_transform")):
        return None
    source, result = static_shape(call.args[0]), static_shape(call)
    if source is None or result is None:
        return None
    if len(source) == 5 and len(result) == 4 and result[1] == source[1] * source[4]:
        block = source[4]
        if _maps(call, [0, 1, 2, 3, 4], [0, block + 4, 2, 3]):
            return "to_nchw", block
    if len(source) == 4 and len(result) == 5 and source[1] == result[1] * result[4]:
        block = result[4]
        if _maps(call, [0, block + 4, 2, 3], [0, 1, 2, 3, 4]):
            return "to_blocked", block
    return None


@mutator
class _TransformSinker(PyExprMutator):
    """One walk in binding order; ``blocked[var] = (source, x)`` for every variable that is
    ``to_nchw(source)`` with block ``x``."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.blocked: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.builder_.normalize(self.visit_expr(binding.value))
        kind = _transform_kind(value)
        if kind is not None and kind[0] == "to_blocked" and value.args[0] in self.blocked:
            source, block = self.blocked[value.args[0]]
            if block == kind[1]:  # met its inverse
                self.set_var_remap(binding.var, source if isinstance(binding.var, relax.DataflowVar)
                                   else rebind(self.builder_, binding.var, source))
                return
        sunk = self._sunk(value) if kind is None else None
        if sunk is None:
            var = rebind(self.builder_, binding.var, value)
            if kind is not None and kind[0] == "to_nchw":
                self.blocked[var] = (value.args[0], kind[1])
            self.set_var_remap(binding.var, var)
            return
        call, block = sunk
        source = self.builder_.emit(call, str(binding.var.name))
        var = rebind(self.builder_, binding.var, to_nchw(source, block), f"{binding.var.name}_nchw")
        self.blocked[var] = (source, block)
        self.set_var_remap(binding.var, var)

    def _sunk(self, call) -> tuple[relax.Call, int] | None:
        """``call`` on the blocked sources, and their block; None when it does not commute."""
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            return None
        if call.op.name == "relax.image.resize2d" and call.args[0] in self.blocked and call.attrs.layout == "NCHW":
            source, block = self.blocked[call.args[0]]
            attrs = call.attrs
            return relax.op.image.resize2d(
                source, call.args[1], roi=list(attrs.roi), layout=f"NCHW{block}c", method=attrs.method,
                coordinate_transformation_mode=attrs.coordinate_transformation_mode,
                rounding_method=attrs.rounding_method, cubic_alpha=attrs.cubic_alpha,
                cubic_exclude=attrs.cubic_exclude, extrapolation_value=attrs.extrapolation_value,
                out_dtype=None if str(attrs.out_dtype) in ("", "void") else attrs.out_dtype), block
        if call.op.name == "relax.strided_slice" and call.args[0] in self.blocked:
            source, block = self.blocked[call.args[0]]
            axes, begin, end = (int_tuple(arg) for arg in call.args[1:4])
            strides = int_tuple(call.args[4]) if len(call.args) > 4 else [1]
            if (axes in ([1], [-3]) and strides == [1] and begin[0] % block == 0 and end[0] % block == 0
                    and 0 <= begin[0] < end[0] <= static_shape(call.args[0])[1]):
                return relax.op.strided_slice(source, axes=[1], begin=[begin[0] // block],
                                              end=[end[0] // block]), block
            if axes is not None and all(axis % 4 in (2, 3) for axis in axes):  # rows, columns: the same slice
                return relax.op.strided_slice(source, [axis % 4 for axis in axes], *call.args[2:],
                                              assume_inbound=bool(call.attrs.assume_inbound)), block
            return None
        if call.op.name in ELEMENTWISE_OPS or call.op.name in QUANTIZATION_OPS:
            return self._sunk_elementwise(call)
        if call.op.name == "relax.mean" and call.args[0] in self.blocked and global_pool(call):
            source, block = self.blocked[call.args[0]]
            return relax.op.mean(source, axis=[2, 3], keepdims=True), block
        if call.op.name in ("relax.nn.avg_pool2d", "relax.nn.max_pool2d") and call.args[0] in self.blocked \
                and call.attrs.layout == "NCHW" and call.attrs.out_layout == "NCHW":
            source, block = self.blocked[call.args[0]]
            attrs = call.attrs
            pool = relax.op.nn.avg_pool2d if call.op.name == "relax.nn.avg_pool2d" else relax.op.nn.max_pool2d
            return pool(source, pool_size=list(attrs.pool_size), strides=list(attrs.strides),
                        padding=list(attrs.padding), dilation=list(attrs.dilation), ceil_mode=bool(attrs.ceil_mode),
                        count_include_pad=bool(attrs.count_include_pad), layout=f"NCHW{block}c"), block
        if call.op.name == "relax.concat" and isinstance(call.args[0], relax.Tuple) and tensor_rank(call) == 4:
            fields = list(call.args[0].fields)
            if not fields or any(field not in self.blocked for field in fields):
                return None
            blocks = {self.blocked[field][1] for field in fields}
            if len(blocks) != 1:
                return None
            # Channels: a concat of whole blocks; rows or columns (a circular pad): the same concat.
            return relax.op.concat([self.blocked[field][0] for field in fields], axis=int(call.attrs.axis) % 4), \
                blocks.pop()
        return None

    def _sunk_elementwise(self, call: relax.Call) -> tuple[relax.Call, int] | None:
        """An element-wise op of blocked maps of one shape and scalars on the blocked sources:
        ``clip`` (HardSwish and HardSigmoid are made of it), and what reads it, or a [1]-shaped
        scale (PP-LCNetV3's learnable affine), both of which the inference sends back to NCHW."""
        maps = [arg for arg in call.args if isinstance(arg.ty, relax.TensorType) and not _is_scalar(arg)]
        if not maps or any(m not in self.blocked for m in maps):
            return None
        blocks = {self.blocked[m][1] for m in maps}
        shapes = [static_shape(m) for m in maps]
        if len(blocks) != 1 or None in shapes or len({shape[1] for shape in shapes}) != 1:
            return None  # a broadcast across channels: left as it is (rows, columns and batch may broadcast)
        args = [self.blocked[arg][0] if any(arg.same_as(m) for m in maps) else arg for arg in call.args]
        return relax.Call(call.op, args, call.attrs), blocks.pop()


def _is_scalar(expr: relax.Expr) -> bool:
    shape = static_shape(expr)
    return shape is not None and all(dim == 1 for dim in shape)


@mutator
class _SplitAsSlices(PyExprMutator):
    """``parts = split(x, ..., axis=1)`` of a static 4-D map: each ``parts[i]`` becomes a slice."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.parts: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.builder_.normalize(self.visit_expr(binding.value))
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in self.parts:
            part = self.parts[value.tuple_value][value.index]
            self.set_var_remap(binding.var, part if isinstance(binding.var, relax.DataflowVar)
                               else rebind(self.builder_, binding.var, part))
            return
        var = rebind(self.builder_, binding.var, value)
        self.set_var_remap(binding.var, var)
        bounds = _channel_split_bounds(value)
        if bounds is not None:
            data = value.args[0]
            self.parts[var] = [self.builder_.emit(relax.op.strided_slice(data, axes=[1], begin=[start], end=[stop]),
                                                  f"{binding.var.name}_{index}")
                               for index, (start, stop) in enumerate(bounds)]


def _channel_split_bounds(call) -> list[tuple[int, int]] | None:
    """(start, stop) of each part of a split along the channels of a static 4-D map."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.split")):
        return None
    shape = static_shape(call.args[0])
    if shape is None or len(shape) != 4 or int(call.attrs.axis) not in (1, -3):
        return None
    sections = call.attrs.indices_or_sections
    channels = shape[1]
    if isinstance(sections, tvm.tirx.IntImm):
        step = channels // int(sections)
        cuts = [step * i for i in range(1, int(sections))]
    else:
        cuts = [int(i) for i in sections]
    edges = [0, *cuts, channels]
    return list(zip(edges[:-1], edges[1:]))
