"""``com.microsoft`` QOperator ops that ONNX Runtime computes through float32 values of the 256
inputs (QLinearSigmoid, QLinearLeakyRelu, QLinearConcat, QLinearAveragePool), bit for bit.

ONNX Runtime's kernels for these ops:

* QLinearSigmoid, QLinearLeakyRelu, QLinearConcat: a 256-entry table, built in float32:
  ``x_scale * (x - x_zp)``, the function (MLAS's logistic for Sigmoid: a rational polynomial
  evaluated with fma, clamped to [-18, 18]; ``v >= 0 ? v : alpha * v``; the identity), then
  MLAS's quantization: ``v / y_scale`` clamped to the range minus ``y_zp``, rounded half to
  even, plus ``y_zp``. Concat copies an input whose scale and zero point are the output's.
* QLinearAveragePool: each input dequantized in float32 as above, each window summed in float32
  in row order (padding skipped, so adding our zeros changes nothing), divided by its count,
  then ``nearbyint(y / y_scale + y_zp)`` saturated (the zero point added before the rounding).

The tables are computed here in numpy at import time (fma exactly, with fractions), so the
model only gathers from them: no float arithmetic of ours, and no compiler contraction, can
move a value across a rounding boundary. The average pool's run-time float work is adds and
divides only (nothing an fma contraction could merge).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.script import tirx as T

from ..errors import ModelError
from ..patterns.base import static_shape
from . import ort_arithmetic
from .qoperator import constant_value, dtype_range, node_name

_F32 = np.float32
# MLAS's logistic in float32: input range, then p's and q's coefficients, highest first.
_LOGISTIC_RANGE, _LOGISTIC_P, _LOGISTIC_Q = ([_F32(v) for v in part] for part in ort_arithmetic.LOGISTIC)


def _rounded_f32(value: Fraction) -> np.float32:
    """``value`` rounded to the nearest float32, ties to even (float64 first can round twice)."""
    guess = _F32(float(value))
    candidates = [np.nextafter(guess, _F32(-np.inf)), guess, np.nextafter(guess, _F32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.asarray(c).view(np.int32)) & 1))


def _fma32(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
    """float32 ``a * b + c`` rounded once, as an fma instruction computes it."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, _F32) for v in (a, b, c)))
    exact = [Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)) for x, y, z in zip(a.flat, b.flat, c.flat)]
    return np.array([_rounded_f32(v) for v in exact], _F32).reshape(a.shape)


def mlas_logistic(values: np.ndarray) -> np.ndarray:
    """MLAS's float32 logistic (its FMA kernel) of float32 ``values``."""
    x = np.clip(np.asarray(values, _F32), *_LOGISTIC_RANGE)
    square = x * x
    p = _fma32(square, _LOGISTIC_P[0], _LOGISTIC_P[1])
    for coefficient in _LOGISTIC_P[2:]:
        p = _fma32(p, square, coefficient)
    p = p * x
    q = _fma32(square, _LOGISTIC_Q[0], _LOGISTIC_Q[1])
    for coefficient in _LOGISTIC_Q[2:]:
        q = _fma32(q, square, coefficient)
    return (p / q + _F32(0.5)).astype(_F32)


def mlas_quantize(values: np.ndarray, scale: np.float32, zero_point: int, dtype: str) -> np.ndarray:
    """MLAS's QuantizeLinear of float32 ``values``: ``v / scale`` clamped to the range minus the
    zero point, rounded half to even, plus the zero point."""
    low, high = dtype_range(dtype)
    scaled = np.clip(np.asarray(values, _F32) / _F32(scale), _F32(low - zero_point), _F32(high - zero_point))
    return (np.round(scaled).astype(np.int32) + zero_point).astype(dtype)


def _dequantized_inputs(scale: np.float32, zero_point: int, dtype: str) -> np.ndarray:
    """float32 ``scale * (x - zero_point)`` of every value x of ``dtype``, lowest first."""
    low, high = dtype_range(dtype)
    return (_F32(scale) * (np.arange(low, high + 1) - zero_point).astype(_F32)).astype(_F32)


def _gather(bb: relax.BlockBuilder, table: np.ndarray, data: relax.Expr) -> relax.Expr:
    """``table[x - lowest]`` for each element x of the 8-bit ``data``."""
    low, _ = dtype_range(str(data.ty.dtype))
    index = R.astype(data, "int32")
    if low:
        index = R.subtract(index, relax.const(low, "int32"))
    return bb.emit(R.take(relax.const(table), index, axis=0))


def _parameters(constant, inputs, names, node) -> list:
    """Scales as float32 and zero points as ints (0 where absent), from constants."""
    values: list = []
    for value, what in zip(inputs, names):
        array = constant_value(constant, value, node, what)
        if what.endswith("zero_point"):
            values.append(0 if array is None else int(np.asarray(array).reshape(-1)[0]))
        else:
            values.append(_F32(np.asarray(array).reshape(-1)[0]))
    return values


def _static_shape(data: relax.Expr, node: str) -> list[int]:
    shape = static_shape(data)
    if shape is None:
        raise ModelError(f"{node}: its input shape {data.ty.shape} is not static",
                         "give every input a fixed size (--input-shape NAME:DIMxDIM)")
    return list(shape)


def _output_dtype(zero_point: relax.Expr | None, data: relax.Expr) -> str:
    return str((zero_point if zero_point is not None else data).ty.dtype)


def _table_op(bb, inputs, constant, node: str, function) -> relax.Expr:
    x, x_scale, x_zp, y_scale = inputs[:4]
    y_zp = inputs[4] if len(inputs) > 4 else None
    sx, zx, sy, zy = _parameters(constant, [x_scale, x_zp, y_scale, y_zp],
                                 ["X_scale", "X_zero_point", "Y_scale", "Y_zero_point"], node)
    dtype = _output_dtype(y_zp, x)
    table = mlas_quantize(function(_dequantized_inputs(sx, zx, str(x.ty.dtype))), sy, zy, dtype)
    return _gather(bb, table, x)


def qlinear_sigmoid(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearSigmoid: a table of MLAS's logistic."""
    return _table_op(bb, inputs, constant, node_name(attrs, "QLinearSigmoid"), mlas_logistic)


def qlinear_leaky_relu(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearLeakyRelu: a table of ``v >= 0 ? v : alpha * v``."""
    alpha = _F32(attrs.get("alpha", 0.01))
    return _table_op(bb, inputs, constant, node_name(attrs, "QLinearLeakyRelu"),
                     lambda v: np.where(v >= 0, v, alpha * v).astype(_F32))


def qlinear_concat(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearConcat: each input requantized to the output's scale and zero point
    through a table (copied where they are already the output's), then concatenated."""
    node = node_name(attrs, "QLinearConcat")
    sy, zy = _parameters(constant, inputs[:2], ["Y_scale", "Y_zero_point"], node)
    dtype = _output_dtype(inputs[1], inputs[2])
    parts = []
    for start in range(2, len(inputs), 3):
        x, x_scale, x_zp = inputs[start:start + 3]
        sx, zx = _parameters(constant, [x_scale, x_zp], ["X_scale", "X_zero_point"], node)
        if sx == sy and zx == zy:
            parts.append(x)
        else:
            parts.append(_gather(bb, mlas_quantize(_dequantized_inputs(sx, zx, str(x.ty.dtype)), sy, zy, dtype), x))
    return R.concat(parts, axis=int(attrs.get("axis", 0)))


def qlinear_average_pool(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearAveragePool (see the module docstring), NCHW or channels-last."""
    node = node_name(attrs, "QLinearAveragePool")
    x, x_scale, x_zp, y_scale = inputs[:4]
    y_zp = inputs[4] if len(inputs) > 4 else None
    sx, zx, sy, zy = _parameters(constant, [x_scale, x_zp, y_scale, y_zp],
                                 ["x_scale", "x_zero_point", "y_scale", "y_zero_point"], node)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", ""):
        raise ModelError(f"{node}: auto_pad {auto_pad} is not supported", "write explicit pads")
    kernel = [int(k) for k in attrs["kernel_shape"]]
    rank = len(kernel)
    strides = [int(s) for s in attrs.get("strides", [1] * rank)]
    pads = [int(p) for p in attrs.get("pads", [0] * 2 * rank)]
    channels_last = bool(attrs.get("channels_last", 0))
    spatial_axes = list(range(1, 1 + rank)) if channels_last else list(range(2, 2 + rank))
    sizes = [_static_shape(x, node)[a] for a in spatial_axes]
    outs = [_pooled_size(n, k, s, pads[i], pads[i + rank], bool(attrs.get("ceil_mode", 0)))
            for i, (n, k, s) in enumerate(zip(sizes, kernel, strides))]
    dequantized = _gather(bb, _dequantized_inputs(sx, zx, str(x.ty.dtype)), x)
    pad_width = [0] * (2 * x.ty.ndim)
    for i, axis in enumerate(spatial_axes):
        tail = max(pads[i + rank], (outs[i] - 1) * strides[i] + kernel[i] - sizes[i] - pads[i])
        pad_width[2 * axis], pad_width[2 * axis + 1] = pads[i], tail
    padded = bb.emit(R.nn.pad(dequantized, pad_width)) if any(pad_width) else dequantized
    total = None
    for offsets in np.ndindex(*kernel):  # row order, as ONNX Runtime sums a window
        window = R.strided_slice(padded, spatial_axes, list(offsets),
                                 [o + (n - 1) * s + 1 for o, n, s in zip(offsets, outs, strides)], strides)
        total = window if total is None else R.add(total, window)
    counts = _window_counts(sizes, kernel, strides, pads[:rank], outs, bool(attrs.get("count_include_pad", 0)))
    shape = [1] * x.ty.ndim
    for axis, size in zip(spatial_axes, outs):
        shape[axis] = size
    mean = bb.emit(R.divide(total, relax.const(counts.reshape(shape))))
    dtype = _output_dtype(y_zp, x)
    low, high = dtype_range(dtype)
    shifted = R.add(R.divide(mean, relax.const(sy)), relax.const(_F32(zy)))
    return R.astype(R.clip(R.round(shifted), low, high), dtype)


def _pooled_size(size: int, kernel: int, stride: int, head: int, tail: int, ceil_mode: bool) -> int:
    span = size + head + tail - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + head:  # the last window would start in the padding
        out -= 1
    return out


def _window_counts(sizes, kernel, strides, heads, outs, include_pad: bool) -> np.ndarray:
    """float32 element count of each output's window, as ONNX Runtime divides by it."""
    per_axis = []
    for size, k, s, head, out in zip(sizes, kernel, strides, heads, outs):
        starts = np.arange(out) * s - head
        ends = np.minimum(starts + k, size)
        per_axis.append(np.full(out, k) if include_pad else ends - np.maximum(starts, 0))
    counts = per_axis[0]
    for axis_counts in per_axis[1:]:
        counts = np.multiply.outer(counts, axis_counts)
    return counts.astype(_F32)


def qlinear_softmax(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearSoftmax as ONNX Runtime computes it: ``e = E[255 - (max - x)]`` from
    a 256-entry float32 table of ``exp((i - 255 + shift) * x_scale)`` (computed in double, the
    shift keeping the row's sum finite), the row's sum added up in float32 left to right, and
    ``nearbyint(e * floor(1 / y_scale) / sum) + y_zp`` (capped at 255; an int8 result wraps past
    127 as ONNX Runtime's does). Over the last axis of a 2-D view: ``opset`` below 13 softmaxes
    all axes from ``axis`` on, 13 and later the one axis (moved last and back)."""
    node = node_name(attrs, "QLinearSoftmax")
    x, x_scale, x_zp, y_scale = inputs[:4]
    y_zp = inputs[4] if len(inputs) > 4 else None
    sx, _, sy, zy = _parameters(constant, [x_scale, x_zp, y_scale, y_zp],
                                ["X_scale", "x_zero_point", "y_scale", "y_zero_point"], node)
    opset = int(attrs.get("opset", 13))
    rank = x.ty.ndim
    axis = int(attrs.get("axis", -1 if opset >= 13 else 1)) % rank
    shape = _static_shape(x, node)
    permutation = None
    if opset >= 13 and axis != rank - 1:
        permutation = list(range(rank))
        permutation[axis], permutation[-1] = rank - 1, axis
        x = bb.emit(R.permute_dims(x, permutation))
        shape = [shape[p] for p in permutation]
        axis = rank - 1
    depth = int(np.prod(shape[axis:]))
    rows = int(np.prod(shape[:axis]))
    table = softmax_table(sx, depth)
    dtype = str(x.ty.dtype)
    kernel = bb.add_func(_softmax_kernel(rows, depth, dtype, float(np.floor(_F32(1.0) / sy)), zy), "qlinear_softmax")
    flat = bb.emit(R.reshape(x, [rows, depth]))
    out = bb.emit(relax.call_tir(kernel, [flat, relax.const(table)], relax.TensorType([rows, depth], dtype)))
    out = bb.emit(R.reshape(out, shape))
    return out if permutation is None else R.permute_dims(out, permutation)


def softmax_table(x_scale: np.float32, depth: int) -> np.ndarray:
    """ONNX Runtime's QLinearSoftmax table: ``float32(exp((i - 255 + shift) * x_scale))`` in
    double, ``shift = max(0, log(FLT_MAX / depth) - 5) / x_scale`` with the quotient and its log
    in float32 (C++'s float overload of ``log``; the double log shifts the table by enough to
    flip a rare output), the rest in double."""
    log = _F32(math.log(float(np.finfo(_F32).max / _F32(depth))))  # logf, correctly rounded
    shift = max(0.0, float(log) - 5.0) / float(x_scale)
    return np.array([math.exp((float(i) - 255 + shift) * float(x_scale)) for i in range(256)]).astype(_F32)


def _softmax_kernel(rows: int, depth: int, dtype: str, y_scale: float, zero_point: int) -> tvm.tirx.PrimFunc:
    """The rows' max, their float32 sums left to right and the quantized quotients, as serial
    loops (marked scheduled: a schedule that split the sum would round it differently)."""
    wraps = dtype == "int8"

    @T.prim_func(private=True)
    def kernel(x: T.Buffer((rows, depth), dtype), table: T.Buffer((256,), "float32"),
               y: T.Buffer((rows, depth), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        top = T.alloc_buffer((1,), "int32")
        total = T.alloc_buffer((1,), "float32")
        for n in T.serial(rows):
            top[0] = T.int32(-256)
            for d in T.serial(depth):
                top[0] = T.max(top[0], T.Cast("int32", x[n, d]))
            total[0] = T.float32(0)
            for d in T.serial(depth):
                total[0] = total[0] + table[255 - top[0] + T.Cast("int32", x[n, d])]
            for d in T.serial(depth):
                q = T.Cast("int32", T.round(table[255 - top[0] + T.Cast("int32", x[n, d])] * T.float32(y_scale)
                                            / total[0])) + zero_point
                if wraps:
                    y[n, d] = T.Select(q > 255, T.Cast(dtype, -1), T.Cast(dtype, q))
                else:
                    y[n, d] = T.Cast(dtype, T.min(q, 255))

    return kernel
