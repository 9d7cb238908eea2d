"""What the reference implementations of the fused ops share (``tvm-fusion inspect --onnx``).

Each ``tvm_fusion``-domain op is an ``onnx.reference`` OpRun (a ``FusedOp``) written in numpy
from the op's definition, declared by its pattern beside its builder (``fusions/<pattern>.py``),
so that ``registry.evaluator`` runs a fused file and says whether the fused graph still computes
what the original did. No TVM here: these define what our kernels must compute, they do not
restate them. This module holds the pieces several ops are made of: activations, the
element-wise tail of an epilogue, the norms and softmax.
"""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

DOMAIN = "tvm_fusion"
_erf = np.vectorize(math.erf, otypes=[np.float64])


class FusedOp(OpRun):
    """The base of every op of the ``tvm_fusion`` domain; the class name is the op type."""

    op_domain = DOMAIN
    op_schema = None  # not the standard op of the same name (Attention, opset 23)


# activations --------------------------------------------------------------------------------

def apply_activation(x: np.ndarray, name: str, params=None) -> np.ndarray:
    """``name`` applied to x; ``params`` are clip's (min, max), leakyrelu's (alpha,) or
    hardsigmoid's (alpha, beta). The empty name is the identity."""
    params = list(params or [])
    with np.errstate(over="ignore"):
        if not name:
            result = x
        elif name == "relu":
            result = np.maximum(x, 0)
        elif name == "sigmoid":
            result = 1 / (1 + np.exp(-x))
        elif name == "tanh":
            result = np.tanh(x)
        elif name == "silu":
            result = x / (1 + np.exp(-x))
        elif name == "gelu":
            result = 0.5 * x * (1 + _erf(x.astype(np.float64) / math.sqrt(2)))
        elif name == "gelu_tanh":
            result = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        elif name == "clip":
            low, high = (params + [-np.inf, np.inf][len(params):])[:2]
            result = np.clip(x, low, high)
        elif name == "leakyrelu":
            alpha = params[0] if params else 0.01
            result = np.where(x >= 0, x, alpha * x)
        elif name == "hardsigmoid":
            alpha, beta = params if params else (0.2, 0.5)
            result = np.clip(alpha * x + beta, 0, 1)
        elif name == "hardswish":
            result = x * np.clip(x / 6 + 0.5, 0, 1)
        else:
            raise ValueError(f"unknown activation {name!r}")
    return np.asarray(result).astype(x.dtype)


# Parameters each activation reads from a tail's ``tail_params``, in order.
ACTIVATION_PARAM_COUNTS = {"clip": 2, "leakyrelu": 1, "hardsigmoid": 2}
_TAIL_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
                "min": np.minimum, "pow": np.power}
_TAIL_UNARY = {"neg": np.negative, "log": np.log, "exp": np.exp, "sqrt": np.sqrt, "abs": np.abs}


def apply_tail(x: np.ndarray, steps, params, operands) -> np.ndarray:
    """The element-wise tail of an epilogue op, step by step in order.

    ``steps``: "add", "sub", "mul", "div", "max", "min", "pow" (x op the next of ``operands``),
    "rsub", "rdiv", "rpow" (the operand op x), "neg", "log", "exp", "sqrt", "abs", or an
    activation name taking its parameters (``ACTIVATION_PARAM_COUNTS``) from the front of ``params``.
    """
    params, operands = list(params or []), list(operands)
    for step in steps or []:
        if step in _TAIL_BINARY:
            x = _TAIL_BINARY[step](x, operands.pop(0))
        elif step in ("rsub", "rdiv", "rpow"):
            x = _TAIL_BINARY[step[1:]](operands.pop(0), x)
        elif step in _TAIL_UNARY:
            x = _TAIL_UNARY[step](x)
        else:
            count = ACTIVATION_PARAM_COUNTS.get(step, 0)
            x, params = apply_activation(x, step, params[:count]), params[count:]
    return np.asarray(x)


def layer_norm(x, gamma, beta, epsilon: float, axis: int) -> np.ndarray:
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    variance = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    result = (x - mean) / np.sqrt(variance + epsilon) * gamma
    return (result if beta is None else result + beta).astype(x.dtype)


def rms_norm(x, gamma, epsilon: float, axis: int) -> np.ndarray:
    axes = tuple(range(axis % x.ndim, x.ndim))
    result = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + epsilon)
    return (result if gamma is None else result * gamma).astype(x.dtype)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def per_channel(value: np.ndarray | None, rank: int = 4) -> np.ndarray | None:
    """A per-channel operand ((C,), (C,1,1) or (1,C,1,1)) as (1, C, 1, ...) for an NC... map."""
    return None if value is None else value.reshape((1, -1) + (1,) * (rank - 2))
