"""QOperator ops (QLinearConv, QLinearMatMul, QGemm, QLinearAdd, QLinearMul, MatMulIntegerToFloat,
DynamicQuantizeMatMul, QLinearGlobalAveragePool) computed as ONNX Runtime's CPU kernels compute
them, bit for bit (the ops ONNX Runtime computes through tables: ``qlinear_lookup.py``).

ONNX Runtime runs these ops, and every QDQ group its optimizer fuses into them
(``qdq_fusion.py``), on integer kernels whose arithmetic is not the float arithmetic of
DequantizeLinear -> op -> QuantizeLinear: one step of difference in a quantized value is a
whole scale step of error after it. So each is written here in ONNX Runtime's order of
operations:

* Conv, MatMul, Gemm: the int32 sum of ``(x - x_zp) * (w - w_zp)`` (plus an int32 bias),
  computed in float32 on those whole numbers (exact below 2^24), or, for a matmul with a
  constant weight on a VNNI target, by the int8 kernel (``integer_matmul.py``, exact), times
  ``float32(x_scale * w_scale / y_scale)`` (one per output channel with per-channel weights),
  rounded half to even, plus ``y_zp``, saturated (MLAS ``MlasRequantizeOutput``).
* QLinearAdd: ``fma(a, ratio_a, fma(b, ratio_b, fixed))`` rounded half to even and saturated,
  ``ratio_a = a_scale / c_scale`` and ``fixed = c_zp - (ratio_a * a_zp + ratio_b * b_zp)`` (MLAS's
  AVX2 kernel, which every x86 CPU with AVX2 runs). A single-rounding fma is a float64 product
  and sum (both exact for these operands) rounded once to float32.
* QLinearMul: ``(a - a_zp) * (b - b_zp) * float32(a_scale * b_scale / c_scale) + c_zp`` (two
  float32 roundings; the add is done in float64 and rounded to float32, so that no compiler
  contracts it into an fma), rounded half to even and saturated.
* MatMulIntegerToFloat, QGemm with a float output: ``float32(acc) * (a_scale * b_scale)``
  (MatMulIntegerToFloat adds its float bias after, QGemm its int32 C before).
  DynamicQuantizeMatMul: the same, A quantized at run time as DynamicQuantizeLinear.
* QLinearGlobalAveragePool: the int32 sum of ``x - x_zp`` over the image, requantized as above
  by ``x_scale / (y_scale * image_size)`` (MLAS ``MlasQLinearGlobalAveragePoolNchw``).

The rounding is ``R.round`` (``nearbyint``: half to even), the scale products are folded in
numpy float32 at import time, and the multiply by the requantization scale is a kernel of its
own (``emit_requantize``), so that no graph pattern folds it into the weights; a conv's is graph
ops (``requantize_ops``), which ``conv_affine_fold`` leaves (it declines whole-number weights),
so that the conv's kernel computes it on its output tile.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax import op as R

from ..errors import ModelError
from ..patterns.base import static_shape
from .integer_matmul import emit_integer_matmul, integer_kernels_enabled, integer_matmul_applies
from .quantized import DynamicQuantization, centered_constant, constant_array, integer_input

_F32 = np.float32


def constant_value(constant, value: relax.Expr | None, node: str, what: str) -> np.ndarray | None:
    """The numpy value of a scale or zero point (None for an absent optional input)."""
    if value is None:
        return None
    return constant_array(value, constant, node, what,
                          "quantize the model with constant scales and zero points (ONNX Runtime's tools do)")


def dtype_range(dtype: str) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _requantize_te(acc: te.Tensor, multiplier: te.Tensor, zero_point: float, dtype: str, channel_axis: int | None):
    """round_half_even(acc * multiplier) + zero_point, saturated to ``dtype``."""
    low, high = dtype_range(dtype)

    def compute(*index):
        scale = multiplier[index[channel_axis]] if channel_axis is not None else multiplier[0]
        value = tvm.tirx.round(acc[index] * scale) + tvm.tirx.const(zero_point, "float32")
        value = tvm.tirx.max(tvm.tirx.min(value, tvm.tirx.const(high, "float32")), tvm.tirx.const(low, "float32"))
        return value.astype(dtype)

    return te.compute(acc.shape, compute, name="requantize")


def emit_requantize(bb: relax.BlockBuilder, acc: relax.Expr, multiplier: np.ndarray, zero_point: np.ndarray | None,
                    dtype: str, channel_axis: int) -> relax.Expr:
    """``acc`` (float32 whole numbers) requantized as MLAS does, one multiplier for all or one
    per channel along ``channel_axis`` (its own kernel: see the module docstring)."""
    multiplier = np.asarray(multiplier, _F32).reshape(-1)
    zero = 0.0 if zero_point is None else float(np.asarray(zero_point).reshape(-1)[0])
    rank = acc.ty.ndim
    axis = None if multiplier.size == 1 else channel_axis % rank
    return bb.emit_te(_requantize_te, acc, relax.const(multiplier), zero, dtype, axis,
                      primfunc_name_hint="requantize")


def requantize_ops(bb: relax.BlockBuilder, acc: relax.Expr, multiplier: np.ndarray, zero_point: np.ndarray | None,
                   dtype: str) -> relax.Expr:
    """A conv's ``acc`` (float32 whole numbers, NCHW) requantized as ``emit_requantize``, but as
    graph ops: the blocked layout carries them, and the conv's kernel computes them on its
    output tile (the conv epilogue's element-wise tail, or FuseOps after an int8 conv kernel)
    instead of a kernel of their own reading the map back."""
    multiplier = np.asarray(multiplier, _F32).reshape(-1)
    scale = multiplier.reshape(()) if multiplier.size == 1 else multiplier.reshape(1, -1, *[1] * (acc.ty.ndim - 2))
    zero = 0.0 if zero_point is None else float(np.asarray(zero_point).reshape(-1)[0])
    low, high = dtype_range(dtype)
    rounded = bb.emit(R.round(R.multiply(acc, relax.const(scale))))
    shifted = bb.emit(R.add(rounded, relax.const(_F32(zero)))) if zero else rounded
    return R.astype(R.clip(shifted, low, high), dtype)


def _scale_product(*factors: np.ndarray) -> np.ndarray:
    """The float32 product of scales, left to right, as C++ computes ``a * b * c`` in float."""
    result = np.asarray(factors[0], _F32).reshape(-1)
    for factor in factors[1:]:
        result = (result * np.asarray(factor, _F32).reshape(-1)).astype(_F32)
    return result


def output_multiplier(x_scale: np.ndarray, w_scale: np.ndarray, y_scale: np.ndarray) -> np.ndarray:
    """``x_scale * w_scale / y_scale`` in float32, in ONNX Runtime's order."""
    return (_scale_product(x_scale, w_scale) / np.asarray(y_scale, _F32).reshape(-1)).astype(_F32)


def centered_weights(bb: relax.BlockBuilder, constant, weights: relax.Expr, zero_point: relax.Expr | None,
                     channel_axis: int) -> relax.Expr:
    """``w - w_zp`` as float32: a constant when ``w`` is one (per-channel zero points along
    ``channel_axis``), else computed (one zero point, or one per channel along the last axis)."""
    centered = constant_centered_weights(constant, weights, zero_point, channel_axis)
    if centered is not None:
        return relax.const(centered)
    if zero_point is not None and zero_point.ty.ndim == 1 and channel_axis % weights.ty.ndim == 0:
        zero_point = bb.emit(R.reshape(zero_point, [-1] + [1] * (weights.ty.ndim - 1)))
    return integer_input(bb, weights, zero_point)


def constant_centered_weights(constant, weights: relax.Expr, zero_point: relax.Expr | None,
                              channel_axis: int) -> np.ndarray | None:
    """``w - w_zp`` as a numpy array of whole numbers when both are constants, else None."""
    folded = constant(weights)
    zp = None if zero_point is None else constant(zero_point)
    if not isinstance(folded, tvm.ir.GenericConst) or not (zp is None or isinstance(zp, tvm.ir.GenericConst)):
        return None
    return centered_constant(folded.value.numpy(), None if zp is None else zp.value.numpy(), channel_axis)


def integer_sum(bb, constant, data: relax.Expr, data_zero_point: relax.Expr | None, weights: relax.Expr,
                weights_zero_point: relax.Expr | None, channel_axis: int = -1, transpose_weights: bool = False,
                dtype: str = "float32") -> relax.Expr:
    """``sum_k (data - data_zp) * (w - w_zp)`` of a matmul (``data @ w``, or ``data @ w.T``), as
    ``dtype`` whole numbers: the int8 kernel (``integer_matmul.py``) for a constant weight and one
    zero point of the data (a constant, or a scalar computed at run time), on a target with
    AVX512-VNNI; else float32 products of the centered values (``centered_weights``)."""
    centered = constant_centered_weights(constant, weights, weights_zero_point, channel_axis)
    if centered is not None and transpose_weights and centered.ndim == 2:
        centered = centered.T
    zero = _one_zero_point(constant, data_zero_point)
    if integer_kernels_enabled() and integer_matmul_applies(data, centered) and zero is not _PER_ROW:
        return emit_integer_matmul(bb, data, zero, centered, dtype)
    rhs = centered_weights(bb, constant, weights, weights_zero_point, channel_axis)
    if transpose_weights:
        rhs = bb.emit(R.permute_dims(rhs))
    product = bb.emit(R.matmul(integer_input(bb, data, data_zero_point), rhs))
    return product if dtype == "float32" else bb.emit(R.astype(product, dtype))


_PER_ROW = object()


def _one_zero_point(constant, zero_point: relax.Expr | None):
    """The data's one zero point: an int (None when absent), a one-element Relax expression
    computed at run time, or ``_PER_ROW`` (a zero point per row, or of unknown size)."""
    if zero_point is None:
        return None
    folded = constant(zero_point)
    if isinstance(folded, tvm.ir.GenericConst):
        values = folded.value.numpy()
        return int(values.reshape(-1)[0]) if values.size == 1 else _PER_ROW
    shape = static_shape(zero_point)
    return zero_point if shape is not None and int(np.prod(shape)) == 1 else _PER_ROW


def qlinear_matmul(bb, inputs, attrs, constant) -> relax.Expr:
    """QLinearMatMul: int32 matmul of the centered inputs, requantized."""
    node = node_name(attrs, "QLinearMatMul")
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = inputs
    multiplier = output_multiplier(*(constant_value(constant, v, node, w) for v, w in
                                     ((a_scale, "a_scale"), (b_scale, "b_scale"), (y_scale, "y_scale"))))
    acc = integer_sum(bb, constant, a, a_zp, b, b_zp, channel_axis=-1)
    return emit_requantize(bb, acc, multiplier, constant_value(constant, y_zp, node, "y_zero_point"),
                           _quantized_dtype(y_zp), channel_axis=-1)


def qlinear_conv(bb, inputs, attrs, constant, conv) -> relax.Expr:
    """QLinearConv: the float32 Conv (``conv(data, weights, bias)``: TVM's converter) of the
    centered inputs plus the int32 bias, requantized per output channel."""
    node = node_name(attrs, "QLinearConv")
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = inputs[:8]
    bias = inputs[8] if len(inputs) > 8 else None
    multiplier = output_multiplier(*(constant_value(constant, v, node, what) for v, what in
                                     ((x_scale, "x_scale"), (w_scale, "w_scale"), (y_scale, "y_scale"))))
    data = integer_input(bb, x, x_zp)
    weights = centered_weights(bb, constant, w, w_zp, channel_axis=0)
    if bias is not None:
        bias = bb.emit(R.astype(bias, "float32"))
    acc = bb.normalize(conv(data, weights, bias))
    return requantize_ops(bb, acc, multiplier, constant_value(constant, y_zp, node, "y_zero_point"),
                          _quantized_dtype(y_zp))


def qgemm(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QGemm: ``alpha * A' B' + C`` (C an int32 bias), requantized, or float32
    when there is no output scale."""
    node = node_name(attrs, "QGemm")
    a, a_scale, a_zp, b, b_scale, b_zp = inputs[:6]
    bias = inputs[6] if len(inputs) > 6 else None
    y_scale = inputs[7] if len(inputs) > 7 else None
    y_zp = inputs[8] if len(inputs) > 8 else None
    if attrs.get("transA", 0):
        a = bb.emit(R.permute_dims(a))
    acc = integer_sum(bb, constant, a, a_zp, b, b_zp, channel_axis=0 if attrs.get("transB", 0) else 1,
                      transpose_weights=bool(attrs.get("transB", 0)))
    alpha = _F32(attrs.get("alpha", 1.0))
    scales = [constant_value(constant, a_scale, node, "a_scale"), constant_value(constant, b_scale, node, "b_scale")]
    if bias is not None:
        acc = bb.emit(R.add(acc, R.astype(bias, "float32")))
    if y_scale is None:  # float output: (acc + C) * (alpha * a_scale * b_scale)
        return R.multiply(acc, relax.const(_scale_product(alpha, *scales)))
    multiplier = (_scale_product(alpha, *scales) / np.asarray(constant_value(constant, y_scale, node, "y_scale"),
                                                              _F32).reshape(-1)).astype(_F32)
    return emit_requantize(bb, acc, multiplier, constant_value(constant, y_zp, node, "y_zero_point"),
                           _quantized_dtype(y_zp), channel_axis=-1)


def matmul_integer_to_float(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft MatMulIntegerToFloat: ``float32(acc) * (a_scale * b_scale)`` (+ bias)."""
    node = node_name(attrs, "MatMulIntegerToFloat")
    a, b, a_scale, b_scale = inputs[:4]
    a_zp, b_zp, bias = (inputs[i] if len(inputs) > i else None for i in (4, 5, 6))
    acc = integer_sum(bb, constant, a, a_zp, b, b_zp, channel_axis=-1)
    scale = _scale_product(constant_value(constant, a_scale, node, "a_scale"),
                           constant_value(constant, b_scale, node, "b_scale"))
    out = bb.emit(R.multiply(acc, relax.const(scale if scale.size > 1 else scale.reshape(()))))
    return out if bias is None else R.add(out, bias)


def dynamic_quantize_matmul(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft DynamicQuantizeMatMul: A quantized to uint8 at run time (as
    DynamicQuantizeLinear), then MatMulIntegerToFloat's ``float32(acc) * (a_scale * b_scale)``
    (+ bias)."""
    node = node_name(attrs, "DynamicQuantizeMatMul")
    a, b, b_scale = inputs[:3]
    b_zp, bias = (inputs[i] if len(inputs) > i else None for i in (3, 4))
    quantized = DynamicQuantization(bb, a)
    acc = integer_sum(bb, constant, quantized.values, quantized.zero_point, b, b_zp, channel_axis=-1)
    weight_scale = np.asarray(constant_value(constant, b_scale, node, "b_scale"), _F32).reshape(-1)
    scale = bb.emit(R.multiply(quantized.scale, relax.const(weight_scale if weight_scale.size > 1
                                                             else weight_scale.reshape(()))))
    out = bb.emit(R.multiply(acc, scale))
    return out if bias is None else R.add(out, bias)


def qlinear_global_average_pool(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearGlobalAveragePool, as MLAS: the int32 sum of ``x - x_zp`` over the
    image, requantized by ``float32(x_scale / (y_scale * image_size))``."""
    node = node_name(attrs, "QLinearGlobalAveragePool")
    x, x_scale, x_zp, y_scale, y_zp = inputs
    rank = x.ty.ndim
    axes = list(range(1, rank - 1)) if attrs.get("channels_last", 0) else list(range(2, rank))
    shape = static_shape(x)
    if shape is None:
        raise ModelError(f"{node}: its input shape {x.ty.shape} is not static",
                         "give every input a fixed size (--input-shape NAME:DIMxDIM)")
    image_size = int(np.prod([shape[a] for a in axes]))
    # whole numbers up to 255 * image_size: exact in float32 below 2^24, else summed in float64
    dtype = "float32" if 255 * image_size < 1 << 24 else "float64"
    acc = bb.emit(R.sum(R.astype(integer_input(bb, x, x_zp), dtype), axis=axes, keepdims=True))
    multiplier = (np.asarray(constant_value(constant, x_scale, node, "x_scale"), _F32).reshape(-1)
                  / (np.asarray(constant_value(constant, y_scale, node, "y_scale"), _F32).reshape(-1)
                     * _F32(image_size))).astype(_F32)
    if dtype != "float32":
        acc = bb.emit(R.astype(acc, "float32"))  # whole numbers of up to 2^31: requantized as MLAS's float(acc)
    return emit_requantize(bb, acc, multiplier, constant_value(constant, y_zp, node, "y_zero_point"),
                           _quantized_dtype(y_zp), channel_axis=1)


def _binary_parameters(constant, inputs, node):
    a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp = inputs
    values = [constant_value(constant, v, node, what) for v, what in
              ((a_scale, "A_scale"), (a_zp, "A_zero_point"), (b_scale, "B_scale"), (b_zp, "B_zero_point"),
               (c_scale, "C_scale"), (c_zp, "C_zero_point"))]
    scalars = [_F32(0) if v is None else _F32(np.asarray(v).reshape(-1)[0]) for v in values]
    return a, b, scalars, _quantized_dtype(c_zp)


def _saturate(bb, value: relax.Expr, dtype: str) -> relax.Expr:
    low, high = dtype_range(dtype)
    return R.astype(R.clip(R.round(value), low, high), dtype)


def qlinear_add(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearAdd, as MLAS's AVX2 kernel (fma, see the module docstring)."""
    a, b, (sa, za, sb, zb, sc, zc), dtype = _binary_parameters(constant, inputs, node_name(attrs, "QLinearAdd"))
    ratio_a, ratio_b = _F32(sa / sc), _F32(sb / sc)
    fixed = _F32(zc - _F32(_F32(ratio_a * za) + _F32(ratio_b * zb)))
    f64 = [bb.emit(R.astype(v, "float64")) for v in (a, b)]
    inner = bb.emit(R.astype(R.add(R.multiply(f64[1], relax.const(float(ratio_b), "float64")),
                                   relax.const(float(fixed), "float64")), "float32"))
    outer = bb.emit(R.astype(R.add(R.multiply(f64[0], relax.const(float(ratio_a), "float64")),
                                   R.astype(inner, "float64")), "float32"))
    return _saturate(bb, outer, dtype)


def qlinear_mul(bb, inputs, attrs, constant) -> relax.Expr:
    """com.microsoft QLinearMul, as MLAS's kernel (see the module docstring)."""
    a, b, (sa, za, sb, zb, sc, zc), dtype = _binary_parameters(constant, inputs, node_name(attrs, "QLinearMul"))
    ratio = _F32(_F32(sa * sb) / sc)
    product = bb.emit(R.multiply(R.subtract(R.astype(a, "float32"), relax.const(za)),
                                 R.subtract(R.astype(b, "float32"), relax.const(zb))))
    scaled = bb.emit(R.multiply(product, relax.const(ratio)))
    shifted = bb.emit(R.astype(R.add(R.astype(scaled, "float64"), relax.const(float(zc), "float64")), "float32"))
    return _saturate(bb, shifted, dtype)


def _quantized_dtype(zero_point: relax.Expr | None) -> str:
    """A quantized output's type: its zero point's (uint8 without one, as ONNX says)."""
    return "uint8" if zero_point is None else str(zero_point.ty.dtype)


def node_name(attrs, op: str) -> str:
    name = attrs.get("tvm_custom", {}).get("name") if isinstance(attrs, dict) else None
    return f"{op} node {name!r}" if name else f"{op} node"
