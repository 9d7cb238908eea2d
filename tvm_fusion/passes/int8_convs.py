"""Int8Convs: quantized convs (float32 convs of whole numbers) as uint8 x int8 -> int32 kernels.

A QLinearConv, and a QDQ group ONNX Runtime runs as one (``frontend/qdq_fusion.py``), is
imported as a float32 conv of ``x - x_zp`` by the constant ``w - w_zp``
(``frontend/qoperator.py``): exact, but every product is a float32 FMA on four-byte operands.
Here each such ``conv2d`` becomes the kernel of ``frontend/int8_conv.py`` where

* its input is provably whole numbers in a window of 256 values (``byte_offset``): a uint8 or
  int8 tensor cast to float32, less whole-number scalar constants, through layout transforms;
* its weight is a constant of whole numbers in int8's range (``int8_conv_weight``), it is dense
  with at least 16 output pixels (``conv_geometry``), and it sums at least ``MIN_DEPTH``
  products per output value. An NCHW input (an RGB stem) is converted to bytes pixel major, each
  kernel row of a patch one run (``conv_patches.py``), where those runs fill whole groups of 4
  k (``DEPTH_BLOCK``): a stem's 7x7 taps over 4 bytes a pixel then take the tiles instead of
  float32 FMAs on the whole numbers.

It runs after the layout phase (the kernel reads the conv's input in its layout) and before
the fusions: FuseOps then puts the bias, the requantization and the QuantizeLinear and
DequantizeLinear after it into the same kernel. Only for a target with AVX512-VNNI
(``has_vnni``, the target given or else the current one): ``Int8MatmulAmx`` schedules the
kernel on AMX-INT8 tiles, ``Int8MatmulVnni`` on ``vpdpbusd`` registers where there are none
(Zen 4 and 5, Ice Lake, Cascade Lake); without VNNI (AVX2) the float32 conv stays, as an int32
sum without ``vpdpbusd`` is slower than its float32 FMAs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from ..frontend.conv_geometry import TILE_ROW_BYTES, ConvGeometry, conv_geometry, oihw_weight, weight_matrix
from ..frontend.int8_conv import emit_int8_conv2d, int8_conv_weight
from ..frontend.integer_matmul import DEPTH_BLOCK
from ..kernels.cpu_features import has_amx_int8, has_vnni
from ..patterns.base import whole_numbers
from .absorb_dequantized_inputs import dequantization_chain
from .rebinding import rebind

# Products per output value (K) a conv needs: one AMX tile row's 64 bytes. Fewer fill a fraction
# of each tile's depth, and the call around the products costs more than the float32 conv.
MIN_DEPTH = 64
_BYTE_OFFSETS = {"uint8": 0, "int8": 128}  # what makes each value of the type a uint8


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Int8Convs")
class Int8Convs:
    """Convs of whole numbers as int8 kernels, on an AVX512-VNNI target (``target`` None: the
    current one)."""

    def __init__(self, target: Target | None = None):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = self.target or Target.current(allow_none=True)
        if target is None or not has_vnni(target):
            return mod
        rewriter = _Rewriter(mod, TILE_ROW_BYTES if has_amx_int8(target) else 0)
        functions = {gvar: rewriter.visit_expr(func) for gvar, func in mod.functions_items()
                     if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs)}
        if not rewriter.changed:
            return mod
        built = rewriter.builder_.get()  # with the kernels' PrimFuncs
        for gvar, func in functions.items():
            built[gvar] = func
        return built


def int8_conv_of(call: relax.Call, bindings: dict, tile_row_depth: int = 0
                 ) -> tuple[ConvGeometry, np.ndarray, int] | None:
    """(geometry, ``[K, Co]`` int8 weight, the input's byte offset) of a conv the int8 kernel
    computes exactly, or None; ``tile_row_depth`` the k of an AMX A-tile row where tiles may
    read the conv's input directly (``conv_geometry.reads_input_directly``), 0 without AMX."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.nn.conv2d")):
        return None
    geometry = conv_geometry(call, tile_row_depth)
    if isinstance(geometry, str) or geometry.depth < MIN_DEPTH or not isinstance(call.args[1], tvm.ir.GenericConst):
        return None
    if not geometry.data_block and geometry.depth % DEPTH_BLOCK:
        return None  # an NCHW input's pixel-major patch runs must fill whole groups of 4 k
    offset = byte_offset(call.args[0], bindings)
    if offset is None or not 0 <= offset <= 255:  # a zero (the padding) must be a byte too
        return None
    plain = oihw_weight(call.args[1].value.numpy(), str(call.attrs.kernel_layout))
    weight = int8_conv_weight(weight_matrix(plain, geometry))
    return None if weight is None else (geometry, weight, offset)


def byte_offset(expr: relax.Expr, bindings: dict) -> int | None:
    """``c`` where every value of ``expr`` is a whole number ``v`` with ``v + c`` in [0, 255]:
    ``astype(t, "float32")`` of a uint8 (0) or int8 (128) tensor ``t``, less whole-number scalar
    constants (each adds itself), through layout transforms; None for anything else."""
    value = bindings.get(expr, expr)
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    name = value.op.name
    if name == "relax.layout_transform" and value.attrs.pad_value is None:
        return byte_offset(value.args[0], bindings)
    if name == "relax.astype" and str(value.ty.dtype) == "float32":
        return _BYTE_OFFSETS.get(str(value.args[0].ty.dtype))
    if name == "relax.subtract" and isinstance(value.args[1], tvm.ir.GenericConst):
        constant = value.args[1].value.numpy()
        inner = byte_offset(value.args[0], bindings)
        if inner is None or constant.size != 1 or not whole_numbers(constant):
            return None
        return inner + int(constant.reshape(()))
    return None


def uint8_source(expr: relax.Expr, bindings: dict) -> relax.Expr | None:
    """The uint8 tensor ``t`` where ``expr`` is ``astype(t, "float32")`` less scalar constants
    (``dequantization_chain``; ``byte_offset`` 0 plus the constants): ``t`` holds the very bytes
    the kernel would convert ``expr`` back to, so it reads them, a quarter of the bytes, and the
    float32 map is not written at all. None for any other chain."""
    chain = dequantization_chain(expr, bindings.get)
    source = None if chain is None else bindings[chain[0]].args[0]
    return source if source is not None and str(source.ty.dtype) == "uint8" else None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tile_row_depth: int):
        super().__init__(mod)
        self.tile_row_depth = tile_row_depth
        self.bindings: dict = {}
        self.changed = False

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.bindings[binding.var] = binding.value
        value = self.visit_expr(binding.value)
        found = int8_conv_of(binding.value, self.bindings, self.tile_row_depth)
        if found is None:
            self.set_var_remap(binding.var, rebind(self.builder_, binding.var, value))
            return
        geometry, weight, offset = found
        self.changed = True
        source = uint8_source(binding.value.args[0], self.bindings)
        data = value.args[0] if source is None else self.visit_expr(source)
        kernel = emit_int8_conv2d(self.builder_, data, geometry, weight, offset, binding.var.name)
        if isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, kernel)  # no alias binding: FuseOps does not fuse through one
        else:
            self.set_var_remap(binding.var, rebind(self.builder_, binding.var, kernel))
