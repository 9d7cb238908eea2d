"""Vectorizable legalizations of exp, erf, tanh, the activations built on them, and isnan.

LLVM lowers ``erf``/``exp``/``tanh`` to one scalar libm call per element, which dominated the
GEMM+GELU epilogue and softmax (the matmul itself ran 10x faster than its erf). TVM's
``topi.fast_*`` are polynomial/rational approximations (Eigen's, float32 max error ~1e-7
relative) that vectorize. Used only for float32; other dtypes keep the default legalization.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx, topi

from ..kernels.padded_softmax import padded_softmax, pads


def _float32_only(fast_te):
    """Legalize with ``fast_te`` for float32 inputs, else with the op's registered default."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if call.args[0].ty.dtype != "float32":
            return tvm.ir.Op.get(call.op.name).get_attr("FLegalize")(bb, call)
        return bb.call_te(fast_te, call.args[0], primfunc_name_hint=call.op.name.split(".")[-1])

    return legalize


def _gelu(x: te.Tensor) -> te.Tensor:
    erf = topi.fast_erf(topi.multiply(x, tirx.const(1.0 / math.sqrt(2.0), x.dtype)))
    return topi.multiply(x, topi.add(tirx.const(0.5, x.dtype), topi.multiply(erf, tirx.const(0.5, x.dtype))))


def _gelu_tanh(x: te.Tensor) -> te.Tensor:
    cube_term = topi.multiply(tirx.const(0.044715, x.dtype), topi.multiply(x, topi.multiply(x, x)))
    inner = topi.multiply(tirx.const(math.sqrt(2.0 / math.pi), x.dtype), topi.add(x, cube_term))
    half_x = topi.multiply(tirx.const(0.5, x.dtype), x)
    return topi.multiply(half_x, topi.add(tirx.const(1.0, x.dtype), topi.fast_tanh(inner)))


def _sigmoid(x: te.Tensor) -> te.Tensor:
    one = tirx.const(1.0, x.dtype)
    return topi.divide(one, topi.add(one, topi.fast_exp(topi.negative(x))))


def _silu(x: te.Tensor) -> te.Tensor:
    return topi.multiply(x, _sigmoid(x))


def _isnan(x: te.Tensor) -> te.Tensor:
    """NaN as its bits: an exponent of all ones and a nonzero mantissa. ``tirx.isnan`` is an
    intrinsic call the vectorizer cannot widen: the whole loop around it ran scalar, LLVM's own
    vectorizer then gathering the loads (a nan-guarded softmax: 15 % of minilm-l6's attention
    kernel). ``x != x`` is no substitute: the simplifier folds it to false."""
    magnitude = tirx.const(0x7FFFFFFF, "int32")
    infinity = tirx.const(0x7F800000, "int32")
    return te.compute(x.shape, lambda *i: tirx.bitwise_and(tirx.reinterpret("int32", x(*i)), magnitude) > infinity,
                      name="isnan")


def _softmax(pad_rows: bool):
    """A float32 softmax with ``fast_exp``; with ``pad_rows``, over a last axis whole vectors do
    not divide, with its reductions over the padded axis (``kernels/padded_softmax.py``)."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        data = call.args[0]
        if data.ty.dtype != "float32":
            return tvm.ir.Op.get(call.op.name).get_attr("FLegalize")(bb, call)
        axis = int(call.attrs.axis)
        shape = data.ty.shape
        if pad_rows and axis in (-1, data.ty.ndim - 1) and isinstance(shape, relax.ShapeExpr) and pads(
                shape.values[-1]):
            return bb.call_te(padded_softmax, data, primfunc_name_hint="softmax")
        return bb.call_te(topi.nn.fast_softmax, data, axis, primfunc_name_hint="softmax")

    return legalize


def fast_math_legalize_map(cpu: bool = True) -> dict:
    """The legalizations above; a softmax's rows padded for the CPU rule (``cpu``), not for the
    GPU's warp reductions."""
    return {
        "relax.exp": _float32_only(topi.fast_exp),
        "relax.erf": _float32_only(topi.fast_erf),
        "relax.tanh": _float32_only(topi.fast_tanh),
        "relax.sigmoid": _float32_only(_sigmoid),
        "relax.nn.gelu": _float32_only(_gelu),
        "relax.nn.gelu_tanh": _float32_only(_gelu_tanh),
        "relax.nn.silu": _float32_only(_silu),
        "relax.nn.softmax": _softmax(pad_rows=cpu),
        "relax.isnan": _float32_only(_isnan),
    }
