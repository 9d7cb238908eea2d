"""ONNX Runtime's CPU arithmetic where it is not IEEE's: MLAS's rational logistic and tanh
(onnxruntime's mlas/lib/logistic.cpp, tanh.cpp), the GRU gates' own versions of them, and
products that it rounds on their own before a sum. Our LSTM/GRU steps and the QLinear table ops
compute with these to match ONNX Runtime bit for bit.

Each approximation: the input range it is clamped to, then the numerator's and the
denominator's coefficients in x², highest power first.
"""

from __future__ import annotations

from typing import Callable

from tvm import te, tirx
from tvm.target import codegen

LOGISTIC = ((-18.0, 18.0),
            (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03,
             2.48287947061529e-01),
            (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03,
             1.16817656904453e-01, 9.93151921023180e-01))
TANH = ((-9.0, 9.0),
        (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
         1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03),
        (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03))


def _ratio(x: te.Tensor, constants: tuple, fused: bool, scale: float = 1.0) -> Callable:
    """``v · p(v²) / q(v²)`` of ``v = scale · clamp(x)``, with Horner steps ``a · v² + c``:
    ``fused``: as MLAS's kernels evaluate them, one multiply-add each, which LLVM contracts into
    an fma where the target has one, as MLAS's FMA3 kernels (``LogisticKernelFma3``,
    ``TanhKernelFma3``) compute it (its SSE2 kernels round twice, as LLVM does without fma);
    else rounded twice everywhere, as ``rnn_helpers.cc`` (built for plain x86-64) computes them."""
    (low, high), numerator, denominator = constants

    def times(value, square):
        return value * square if fused else _fenced(value * square)

    def horner(square, coefficients):
        value = tirx.const(coefficients[0], "float32")
        for coefficient in coefficients[1:]:
            value = times(value, square) + tirx.const(coefficient, "float32")
        return value

    def ratio(*index):
        value = tirx.min(tirx.max(x(*index), tirx.const(low, "float32")), tirx.const(high, "float32"))
        if scale != 1.0:
            value = value * tirx.const(scale, "float32")
        square = value * value
        return value * horner(square, numerator) / horner(square, denominator)

    return ratio


def mlas_logistic(x: te.Tensor) -> te.Tensor:
    """MLAS's logistic (``MlasComputeLogistic``): ``max(p/q + 0.5, 0)``."""
    ratio = _ratio(x, LOGISTIC, fused=True)
    return te.compute(x.shape, lambda *i: tirx.max(ratio(*i) + tirx.const(0.5, "float32"), tirx.const(0.0, "float32")),
                      name="mlas_logistic")


def mlas_tanh(x: te.Tensor) -> te.Tensor:
    """MLAS's tanh (``MlasComputeTanh``): ``p/q`` (no small-input shortcut, unlike ``topi.fast_tanh``)."""
    return te.compute(x.shape, _ratio(x, TANH, fused=True), name="mlas_tanh")


def gru_logistic(x: te.Tensor) -> te.Tensor:
    """``gru_reset_gate_sigmoid``'s logistic: ``0.5 · (1 + tanh(x / 2))``, x clamped to ±20, with
    MLAS's tanh coefficients unclamped, every product rounded."""
    ratio = _ratio(x, ((-20.0, 20.0),) + TANH[1:], fused=False, scale=0.5)
    return te.compute(x.shape, lambda *i: tirx.const(0.5, "float32") * (tirx.const(1.0, "float32") + ratio(*i)),
                      name="gru_logistic")


def gru_tanh(x: te.Tensor) -> te.Tensor:
    """``gru_output_gate_tanh``'s tanh: x clamped to ±10, MLAS's coefficients, every product rounded."""
    return te.compute(x.shape, _ratio(x, ((-10.0, 10.0),) + TANH[1:], fused=False), name="gru_tanh")


def _fenced(value: tirx.PrimExpr, dtype: str = "float32") -> tirx.PrimExpr:
    return tirx.call_llvm_pure_intrin(dtype, "llvm.arithmetic.fence", value)


_FENCE = codegen.llvm_lookup_intrinsic_id("llvm.arithmetic.fence")


def _without_fence(call: tirx.Call) -> tirx.PrimExpr:
    """The fenced value itself, for code generators that know no LLVM intrinsics (a GPU's
    arithmetic is not ONNX Runtime's CPU arithmetic to match anyway)."""
    return call.args[1] if int(call.args[0]) == _FENCE else call


for _target in ("cuda", "metal", "opencl", "vulkan", "webgpu"):
    tirx.op.register_intrin_lowering("tirx.call_llvm_pure_intrin", _target, f=_without_fence, level=99)


def fence(x: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *i: _fenced(x(*i), x.dtype), name="rounded")
