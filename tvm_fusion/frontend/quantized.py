"""Dynamically quantized ops (``onnxruntime.quantization.quantize_dynamic`` output) in float32.

``quantize_dynamic`` rewrites Conv as DynamicQuantizeLinear + ConvInteger and LSTM as the
``com.microsoft`` DynamicQuantizeLSTM; TVM has no converter for either. Their integer products
are computed here in float32 on the integer values (``q - zero_point``): every product and
partial sum is a whole number, exact in float32 below 2^24, so the result is ONNX Runtime's
int32 accumulation, and the convs and matmuls run on our float32 kernels instead of TVM's
unscheduled int32 loops.

Activations are quantized as ONNX Runtime does (``GetQuantizationParameter``): the range is
widened to include 0, scale = range / 255 (1 for an empty range, where TVM's own
DynamicQuantizeLinear divides by zero), the zero point and the values are rounded half to even.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from ..errors import ModelError


class DynamicQuantization:
    """uint8 quantization of a float32 tensor with one scale and zero point for all of it."""

    def __init__(self, bb: relax.BlockBuilder, data: relax.Expr):
        zero = relax.const(0.0, "float32")
        low = R.minimum(R.min(data), zero)
        high = R.maximum(R.max(data), zero)
        span = bb.emit(R.subtract(high, low))
        self.scale = bb.emit(R.where(R.equal(span, zero), relax.const(1.0, "float32"),
                                     R.divide(span, relax.const(255.0, "float32"))))
        self.zero_point = bb.emit(R.round(R.clip(R.negative(R.divide(low, self.scale)), 0.0, 255.0)))
        self.values = bb.emit(R.clip(R.add(R.round(R.divide(data, self.scale)), self.zero_point), 0.0, 255.0))

    def centered(self, bb: relax.BlockBuilder) -> relax.Expr:
        """``q - zero_point`` (whole numbers in [-255, 255]) as float32."""
        return bb.emit(R.subtract(self.values, self.zero_point))


def centered_constant(values: np.ndarray, zero_point: np.ndarray | None, channel_axis: int) -> np.ndarray:
    """An integer constant minus its zero point, as float32: one zero point for all, or one per
    channel along ``channel_axis``."""
    result = values.astype(np.float32)
    if zero_point is None:
        return result
    zero_point = zero_point.astype(np.float32).reshape(-1)
    if zero_point.size == 1:
        return result - zero_point[0]
    shape = [1] * result.ndim
    shape[channel_axis] = zero_point.size
    return result - zero_point.reshape(shape)


def constant_array(value, constant, node: str, what: str,
                   hint: str = "quantize the model with constant weights (quantize_dynamic writes them as "
                               "initializers)") -> np.ndarray:
    """The numpy value of a converter input that must be an initializer (quantized weights are)."""
    folded = constant(value)
    if not isinstance(folded, tvm.ir.GenericConst):
        raise ModelError(f"{node}: its {what} is computed at run time", hint)
    return folded.value.numpy()


def integer_input(bb: relax.BlockBuilder, data: relax.Expr, zero_point: relax.Expr | None) -> relax.Expr:
    """``data - zero_point`` of an integer tensor computed at run time (or of whole numbers in
    float32, a DynamicQuantizeLinear's), as float32."""
    def as_float(value):
        if str(value.ty.dtype) == "float32":
            return value
        if isinstance(value, tvm.ir.GenericConst):  # a constant, not an op the fusions would stop at
            return relax.const(value.value.numpy().astype(np.float32))
        return R.astype(value, "float32")

    centered = as_float(data)
    if zero_point is not None:
        centered = R.subtract(centered, as_float(zero_point))
    return bb.emit(centered)
