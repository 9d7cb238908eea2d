"""FoldConstantsSafely: FoldConstant, kept only when its result is a well-formed module.

The canonicalize phase folds the importer's constant computations (Clip bounds, shape
arithmetic) so rewrite rules see plain constants. In TVM 0.27, FoldConstant on a module with
``dynamic_strided_slice`` (ONNX Slice with run-time starts) leaves a call to a ``shape_func``
it never defines, and the build fails later; such a module is kept unfolded instead.

Reshapes, transposes and layout transforms of a constant (a bias reshaped to 1xCx1x1, every
conv weight the blocked layout converts) are folded first, in numpy: FoldConstant compiles each
with LLVM, 70-80 ms apiece, 14 of nudenet's 35 s pipeline. A layout transform's index map is
evaluated on the weight's index grid and each element scattered to where the map sends it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from .rebinding import replace_values


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FoldConstantsSafely")
class FoldConstantsSafely:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = fold_constant_layout_changes(mod)
        folded = relax.transform.FoldConstant()(mod)
        return folded if relax.analysis.check_well_formed(folded) else mod


def fold_constant_layout_changes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every reshape, transpose and layout transform of a constant replaced by its
    result (a layout transform whose index map ``transformed_constant`` cannot evaluate is left
    to FoldConstant)."""
    return replace_values(mod, _folded_layout_change)


def _folded_layout_change(value: relax.Expr) -> relax.Expr | None:
    if not (isinstance(value, relax.Call) and value.args and isinstance(value.args[0], tvm.ir.GenericConst)):
        return None
    folded = _layout_changed(value, value.args[0].value.numpy())
    return None if folded is None else relax.const(folded, str(folded.dtype))


def _layout_changed(call: relax.Call, array: np.ndarray) -> np.ndarray | None:
    name = getattr(call.op, "name", None)
    if name == "relax.reshape" and isinstance(call.args[1], relax.ShapeExpr):
        shape = call.args[1].values
        return array.reshape([int(dim) for dim in shape]) if all(isinstance(d, tirx.IntImm) for d in shape) else None
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        return np.ascontiguousarray(array.transpose(None if axes is None else [int(axis) for axis in axes]))
    if name == "relax.layout_transform":
        return transformed_constant(array, call.attrs.index_map, call.attrs.pad_value)
    return None


def transformed_constant(array: np.ndarray, index_map: tirx.IndexMap, pad_value) -> np.ndarray | None:
    """``array`` laid out by ``index_map``, the elements no input maps to set to ``pad_value``;
    None when the map uses an operation other than + - * // % on its indices, or pads without
    a value."""
    grid = np.ogrid[tuple(slice(0, n) for n in array.shape)]
    variables = list(zip(index_map.initial_indices, grid))
    targets = [_evaluate(expr, variables) for expr in index_map.final_indices]
    if any(target is None for target in targets):
        return None
    shape = [int(dim) for dim in index_map.map_shape(list(array.shape))]
    padded = int(np.prod(shape)) != array.size
    if padded and pad_value is None:
        return None
    out = np.full(shape, pad_value.value if padded else 0, dtype=array.dtype)
    out[tuple(np.broadcast_to(target, array.shape) for target in targets)] = array
    return out


_OPERATIONS = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.FloorDiv: np.floor_divide,
               tirx.FloorMod: np.mod}


def _evaluate(expr, variables: list) -> np.ndarray | int | None:
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return next((grid for var, grid in variables if var.same_as(expr)), None)
    operation = _OPERATIONS.get(type(expr))
    if operation is None:
        return None
    a, b = _evaluate(expr.a, variables), _evaluate(expr.b, variables)
    return None if a is None or b is None else operation(a, b)
