"""A conv2d of whole numbers as the uint8 x int8 -> int32 kernel on its input's patches.

A quantized conv (QLinearConv, a QDQ group: ``qoperator.py``) is a float32 conv of
``x - x_zp`` by ``w - w_zp``: exact, but at the float32 FMA rate on four-byte operands. Where
``passes/int8_convs.py`` proves the input's values are whole numbers in
``[-offset, 255 - offset]`` (a uint8 tensor as float32 less its zero point), ``v + offset`` is
a uint8: the kernel's prologue converts the input to those bytes once, the patches
(``conv_patches.py``) copy them (the padding, a centered zero, is ``offset``), and the sum is
``integer_matmul.py``'s (``Int8MatmulAmx`` puts it on AMX-INT8 tiles) by the weight
``w - w_zp`` as int8, packed at build time. Then

    sum_k v * w = dot(u, w) - offset * colsum(w)

and the output block adds the constant ``-offset * colsum(w)`` to the int32 sum and converts
the total to float32 once: the value the float32 conv computed, as ONNX Runtime's
``float(acc)``, so what follows (bias, requantization) sees the same number.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax, te

from ..patterns.base import whole_numbers
from .conv_geometry import ConvGeometry
from .conv_patches import PatchOperand, output_te, patches_te
from .integer_matmul import DEPTH_BLOCK, pack_weight, sum_te

PRIMFUNC_NAME = "int8_conv2d"  # the kernel's: inspect credits the epilogue FuseOps gives it
# The names and operand of the kernel's blocks; ``emit_int8_conv2d`` fills in each conv's
# conversion and padding (its offset).
INT8_PATCHES = PatchOperand("uint8", DEPTH_BLOCK, lambda v: v.astype("uint8"), 0, "int8_conv_input",
                            "int8_conv_patches", "int8_conv_output")


def int8_conv_weight(weight: np.ndarray) -> np.ndarray | None:
    """The ``[K, Co]`` weight matrix as int8, or None where it is not whole numbers in
    [-128, 127] (uint8 weights far from their zero point: ``integer_matmul.py`` shifts such
    columns and corrects by the row sums, which the patch kernel does not)."""
    if weight.size == 0 or not whole_numbers(weight) or weight.min() < -128 or weight.max() > 127:
        return None
    return weight.astype(np.int8)


def conv_te(data: te.Tensor, packed: te.Tensor, correction: te.Tensor, geometry: ConvGeometry,
            offset: int) -> te.Tensor:
    """Input bytes, patches, int32 sum and output layout (plus ``correction``, as float32) in one kernel."""
    if data.dtype == "uint8":  # the bytes themselves (passes/int8_convs.py, uint8_source)
        convert = lambda v: v  # noqa: E731
    else:
        convert = lambda v: (v + tvm.tirx.const(offset, "float32")).astype("uint8")  # noqa: E731
    operand = dataclasses.replace(INT8_PATCHES, convert=convert, zero=offset)
    total = sum_te(patches_te(data, geometry, operand), packed)
    return output_te(total, geometry, operand.output_name,
                     lambda value, channel: (value + correction[channel]).astype("float32"))


def emit_int8_conv2d(bb: relax.BlockBuilder, data: relax.Expr, geometry: ConvGeometry, weight: np.ndarray,
                     offset: int, name: str = "") -> relax.Expr:
    """The conv of ``data`` (float32 whole numbers, ``v + offset`` in [0, 255], or those bytes
    ``v + offset`` themselves as uint8) by ``weight``
    (``[K, Co]`` int8, ``int8_conv_weight``'s) as one int8 kernel; ``name`` the kernel call's
    binding (the conv's, so its kernel traces back to its node)."""
    packed = relax.const(tvm.runtime.tensor(pack_weight(weight)))
    correction = relax.const((-offset * weight.astype(np.int64).sum(axis=0)).astype(np.int32))
    return bb.emit_te(lambda d, w, c: conv_te(d, w, c, geometry, offset), data, packed, correction,
                      primfunc_name_hint=PRIMFUNC_NAME, name_hint=name)
