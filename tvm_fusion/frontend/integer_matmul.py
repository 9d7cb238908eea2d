"""The integer sum of a quantized matmul with a constant weight, as a uint8 x int8 -> int32 kernel.

QLinearMatMul, QGemm, MatMulInteger, MatMulIntegerToFloat and DynamicQuantizeMatMul all need
``sum_k (a - a_zp) * (w - w_zp)``. Computed in float32 on whole numbers (``quantized.py``) it is
exact below 2^24, but reads four bytes per weight and runs at the float FMA rate. Here it is an
int32 sum of uint8 activations times int8 weights, the operands of x86's ``vpdpbusd`` (VNNI),
with the weight packed at build time in the layout that instruction reads: ``[N/16, K/4, 16, 4]``,
16 output columns by 4 consecutive k (``schedules/cpu/int8_matmul_vnni.py`` tensorizes it). The
import emits it only for a target CPU with AVX512-VNNI (``integer_kernels_enabled``); without,
int32 loops ran slower than the float32 products (``benchmarks/bench_int8.py``), which stay there.

Any signedness becomes uint8 x int8 exactly, by offsets folded into constants at import time:

* an int8 activation is ``a + 128`` as uint8, its zero point ``a_zp + 128``;
* the weight ``w - w_zp`` (whole numbers in [-255, 255]) is stored as ``s = w - w_zp - c`` with
  one shift ``c[n]`` per column, 0 where the column already fits int8, else what brings the
  column's range (at most 256 values wide for one zero point) into [-128, 127];

so that, with ``u`` the uint8 activation and ``z`` its zero point,

    sum_k (u - z) * (s + c) = dot(u, s) - z * colsum(s) + c * (rowsum(u) - K * z)

where ``dot`` is the kernel, ``colsum(s)`` a constant, and the row sum is only computed when
some ``c[n]`` is not 0. K is padded to a multiple of 4 and N to one of 16 with zeros (in the
activation and the weight), which add nothing. Every term is an int32 (|dot| < K * 2^15) and the
result is converted to float32 once, as ONNX Runtime's ``float(acc)``: the requantization after
it sees the very value ONNX Runtime does, also beyond 2^24, where a float32 sum would round.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax import op as R
from tvm.target import Target

from ..kernels.cpu_features import has_vnni
from .packed_weights import COLUMN_BLOCK, pack_panels, round_up

# The dot-product layout (packed_weights.py): 16 int32 lanes of output columns, each summing 4 consecutive k.
DEPTH_BLOCK = 4
KERNEL_NAME = "int8_matmul"  # the sum block's name: the schedule rule looks for it
# Off: every integer sum as float32 products, whatever the target (benchmarks compare the two).
INT8_KERNELS = True


def integer_kernels_enabled() -> bool:
    """Whether the import emits the int8 kernel: for a current target (``with target:``, as
    ``preparation.prepare`` imports) with AVX512-VNNI. Elsewhere the float32 products are the
    faster path (an int32 loop without ``vpdpbusd`` is slower than the float kernel on AVX2 and
    AVX-512 targets, measured by ``benchmarks/bench_int8.py``), so they stay."""
    target = Target.current(allow_none=True)
    return INT8_KERNELS and target is not None and has_vnni(target)


def pack_weight(shifted: np.ndarray) -> np.ndarray:
    """``[K, N]`` int8 as ``[N16/16, K4/4, 16, 4]``, zero-padded: ``packed[j, q, c, r] =
    shifted[4q + r, 16j + c]``."""
    return pack_panels(shifted.astype(np.int8, copy=False), DEPTH_BLOCK)


def int8_weight(centered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w - w_zp`` (``[K, N]`` whole numbers) as int8 ``s`` and the column shifts ``c`` with
    ``centered = s + c``; ValueError for a column wider than 256 values."""
    centered = centered.astype(np.int32)
    high = centered.max(axis=0)
    low = centered.min(axis=0)
    if np.any(high - low > 255):
        raise ValueError("a weight column spans more than 256 values")
    shift = np.where((low >= -128) & (high <= 127), 0, high - 127).astype(np.int32)
    return (centered - shift).astype(np.int8), shift


def activation_te(data: te.Tensor, offset: int, depth: int) -> te.Tensor:
    """``data + offset`` as uint8, zero-padded along the last axis to ``depth``."""
    real = data.shape[-1]

    def compute(*index):
        value = data[index].astype("int32") + offset if offset else data[index]
        return tvm.tirx.if_then_else(index[-1] < real, value.astype("uint8"), tvm.tirx.const(0, "uint8"))

    return te.compute((*data.shape[:-1], depth), compute, name="int8_activation")


def sum_te(data: te.Tensor, packed: te.Tensor) -> te.Tensor:
    """``C[.., m, n] = sum_k int32(data[.., m, k]) * int32(packed[n/16, k/4, n%16, k%4])`` over the
    padded N and K (the form of the VNNI tensor intrinsic's description)."""
    k = te.reduce_axis((0, data.shape[-1]), name="k")
    columns = packed.shape[0] * COLUMN_BLOCK

    def compute(*index):
        *rows, n = index
        weight = packed[n // COLUMN_BLOCK, k // DEPTH_BLOCK, n % COLUMN_BLOCK, k % DEPTH_BLOCK]
        return te.sum(data[(*rows, k)].astype("int32") * weight.astype("int32"), axis=k)

    return te.compute((*data.shape[:-1], columns), compute, name=KERNEL_NAME)


def emit_integer_matmul(bb: relax.BlockBuilder, data: relax.Expr, zero_point, centered: np.ndarray,
                        dtype: str = "float32") -> relax.Expr:
    """``sum_k (data - zero_point) * centered[k, n]`` as ``dtype`` (float32 whole numbers, or
    int32), shaped like ``data`` with its last axis N: ``data`` uint8 or int8, or float32 whole numbers in [0, 255]
    (a DynamicQuantizeLinear); ``zero_point`` a number (None: 0) or a one-element float32 or
    integer tensor computed at run time; ``centered`` the constant ``w - w_zp``, ``[K, N]``."""
    depth, columns = centered.shape
    weight, shift = int8_weight(centered)
    offset = 128 if str(data.ty.dtype) == "int8" else 0
    padded = round_up(depth, DEPTH_BLOCK)
    # Static leading axes as one row axis where that gives the kernel more rows: the tiles see
    # them all at once (an LSTM's input projection, [steps, batch, K], is steps * batch rows, not
    # batch rows per step). Where it would not ([1, rows, K]), the shape stays: the reshapes
    # would only change what FuseOps puts in the kernel.
    *leading, _ = data.ty.shape.values
    static = all(isinstance(d, tvm.tirx.IntImm) for d in leading)
    merged = not leading or (static and int(np.prod([int(d) for d in leading])) > int(leading[-1]))
    rows = bb.emit(R.reshape(data, [int(np.prod([int(d) for d in leading])), depth])) if merged else data
    if offset or padded != depth or str(data.ty.dtype) != "uint8":
        rows = bb.emit_te(activation_te, rows, offset, padded, primfunc_name_hint="int8_activation")
    total = bb.emit_te(sum_te, rows, relax.const(pack_weight(weight)), primfunc_name_hint=KERNEL_NAME)
    if round_up(columns, COLUMN_BLOCK) != columns:
        total = bb.emit(R.strided_slice(total, axes=[rows.ty.ndim - 1], begin=[0], end=[columns]))
    column_sums = weight.astype(np.int64).sum(axis=0)
    if not isinstance(zero_point, relax.Expr):
        zero = int(zero_point or 0) + offset
        acc = R.add(total, relax.const((-zero * column_sums).astype(np.int32))) if zero else total
    else:  # computed at run time (DynamicQuantizeLinear's: a whole number in [0, 255] as float32)
        zero = bb.emit(R.add(R.astype(R.reshape(zero_point, []), "int32"), relax.const(offset, "int32")))
        acc = R.subtract(total, R.multiply(zero, relax.const(column_sums.astype(np.int32))))
    if np.any(shift):
        row_sums = R.sum(R.astype(rows, "int32"), axis=[rows.ty.ndim - 1], keepdims=True)
        zero_sum = relax.const(depth * zero, "int32") if isinstance(zero, int) else R.multiply(
            zero, relax.const(depth, "int32"))
        acc = R.add(acc, R.multiply(R.subtract(row_sums, zero_sum), relax.const(shift)))
    out = bb.emit(R.astype(acc, dtype) if dtype != "int32" else acc)
    return bb.emit(R.reshape(out, [*leading, columns])) if merged else out


def integer_matmul_applies(data: relax.Expr, centered: np.ndarray | None) -> bool:
    """The int8 kernel takes a 2-D constant weight, each column at most 256 values wide (one
    zero point per column makes it so), and an activation of known rank whose last axis is
    static."""
    if centered is None or centered.ndim != 2 or centered.size == 0 or data.ty.ndim < 1:
        return False
    if np.any(centered.max(axis=0).astype(np.int64) - centered.min(axis=0) > 255):
        return False
    shape = data.ty.shape
    return isinstance(shape, relax.ShapeExpr) and isinstance(shape.values[-1], tvm.tirx.IntImm)
