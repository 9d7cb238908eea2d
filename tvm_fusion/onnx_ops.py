"""Reference implementations of the fused ops that ``tvm-fusion inspect --onnx`` writes.

One ``onnx.reference`` OpRun per op of the ``tvm_fusion`` domain, written in numpy from the
op's definition (README, "The fused graph as ONNX"), so that ``ReferenceEvaluator(model,
new_ops=FUSED_OPS)`` runs a fused file and says whether the fused graph still computes what the
original did. No TVM here: these define what our kernels must compute, they do not restate
them. The standard ops a fused op is made of where numpy has no one-liner (Conv,
ConvTranspose, Resize) run through onnx.reference's own implementations of those ops
(``onnx_ops_standard``, which also corrects where onnx.reference departs from ONNX Runtime).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from .onnx_ops_standard import STANDARD_FIXES, resize, standard

DOMAIN = "tvm_fusion"
_erf = np.vectorize(math.erf, otypes=[np.float64])


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
                "min": np.minimum}


def apply_tail(x: np.ndarray, steps, params, operands) -> np.ndarray:
    """The element-wise tail of an epilogue op, step by step in order.

    ``steps``: "add", "sub", "mul", "div", "max", "min" (x op the next of ``operands``),
    "rsub", "rdiv" (the operand op x), "neg", or an activation name taking its parameters
    (``ACTIVATION_PARAM_COUNTS``) from the front of ``params``.
    """
    params, operands = list(params or []), list(operands)
    for step in steps or []:
        if step in _TAIL_BINARY:
            x = _TAIL_BINARY[step](x, operands.pop(0))
        elif step in ("rsub", "rdiv"):
            x = _TAIL_BINARY[step[1:]](operands.pop(0), x)
        elif step == "neg":
            x = -x
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


# fused ops ----------------------------------------------------------------------------------

class _FusedOp(OpRun):
    op_domain = DOMAIN
    op_schema = None  # not the standard op of the same name (Attention, opset 23)


class GemmEpilogue(_FusedOp):
    """Y = reshape(alpha * A·op(B), output_shape) + beta * bias -> activation -> + residual -> tail.

    A 2-D B multiplies A's rows of B's reduction size (an N-D A is a batch of rows, as after
    a flattened-linear rewrite); an N-D B is a batched MatMul with numpy broadcasting. The
    inputs after the residual are the operands of the element-wise ``tail`` (``apply_tail``).
    """

    def _run(self, a, b, bias=None, residual=None, *tail_operands, trans_b=0, alpha=1.0, beta=1.0,
             activation="", activation_params=None, output_shape=None, has_bias=0, has_residual=0, tail=None,
             tail_params=None):
        out = gemm_epilogue(a, b, bias, residual, trans_b, alpha, beta, activation, activation_params,
                            output_shape)
        return (apply_tail(out, tail, tail_params, tail_operands).astype(a.dtype),)


def gemm_epilogue(a, b, bias, residual, trans_b, alpha, beta, activation_name, activation_params,
                  output_shape) -> np.ndarray:
    weight = np.swapaxes(b, -1, -2) if trans_b else b
    if weight.ndim == 2:
        product = a.reshape(-1, weight.shape[0]) @ weight
    else:
        product = np.matmul(a, weight)
    out = product * np.float32(alpha) if alpha != 1.0 else product
    if output_shape is not None:
        out = out.reshape(output_shape)
    if bias is not None:
        out = out + (bias * np.float32(beta) if beta != 1.0 else bias)
    out = apply_activation(out.astype(a.dtype), activation_name, activation_params)
    return (out + residual if residual is not None else out).astype(a.dtype)


class GemmDropout(_FusedOp):
    """A GEMM epilogue then training-mode Dropout: [Y * mask / (1 - ratio), mask].

    The mask is ``uniform >= ratio``, uniform the top 24 bits of Philox-4x32-10's word 0 at
    counter = the element's flat index, key = (seed low, seed high 32 bits), times 2**-24.
    """

    def _run(self, a, b, bias=None, trans_b=0, alpha=1.0, beta=1.0, activation="", activation_params=None,
             output_shape=None, has_bias=0, ratio=0.5, seed=0):
        values = gemm_epilogue(a, b, bias, None, trans_b, alpha, beta, activation, activation_params,
                               output_shape)
        mask = philox_uniform(values.size, seed).reshape(values.shape) >= np.float32(ratio)
        scale = np.float32(1) / (np.float32(1) - np.float32(ratio))
        return np.where(mask, values * scale, 0).astype(values.dtype), mask


def philox_uniform(count: int, seed: int) -> np.ndarray:
    """float32 uniforms in [0, 1): Philox-4x32-10 word 0 at counters 0..count-1 (Random123)."""
    low = np.uint64(0xFFFFFFFF)
    counter = np.arange(count, dtype=np.uint64)
    c = [counter & low, counter >> np.uint64(32), np.zeros_like(counter), np.zeros_like(counter)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = c[0] * np.uint64(0xD2511F53), c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & low,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & low]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return (c[0] >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)


CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
CONV_TRANSPOSE_ATTRIBUTES = CONV_ATTRIBUTES + ("output_padding", "output_shape")


def conv_epilogue(op_type: str, x, w, bias, gate, bn, residual, tail_operands, attributes: dict) -> np.ndarray:
    """tail(post_activation(activation(BN(conv(x * gate, w) + bias)) + residual)), each step optional."""
    if gate is not None:
        x = x * gate
    names = CONV_ATTRIBUTES if op_type == "Conv" else CONV_TRANSPOSE_ATTRIBUTES
    out = standard(op_type, x, w, None, **{name: attributes.get(name) for name in names})
    if bias is not None:
        out = out + per_channel(bias, out.ndim)
    scale, shift, mean, variance = (per_channel(v, out.ndim) for v in bn)
    if mean is not None:
        out = (out - mean) / np.sqrt(variance + np.float32(attributes.get("epsilon", 1e-5))) * scale + shift
    elif scale is not None:  # affine: no mean and variance, out * scale [+ shift]
        out = out * scale if shift is None else out * scale + shift
    out = apply_activation(out.astype(x.dtype), attributes.get("activation", ""), attributes.get("activation_params"))
    if residual is not None:
        if attributes.get("residual") == "upsampled":
            residual = resize(residual, attributes["resize_scales"], attributes)
        out = apply_activation(out + residual, attributes.get("post_activation", ""),
                               attributes.get("post_activation_params"))
    out = apply_tail(out, attributes.get("tail"), attributes.get("tail_params"), tail_operands)
    return out.astype(x.dtype)


class ConvEpilogue(_FusedOp):
    """Conv (NCHW) with an optional per-channel input scale (SE gate) in front and bias,
    inference BatchNormalization (with ``affine`` = 1, no mean and variance: ``* bn_scale [+
    bn_bias]``), activation, residual add (a tensor, or ``residual = "upsampled"``: the small
    map, resized by ``resize_scales`` first), activation after it and the element-wise
    ``tail`` (``apply_tail``), whose operands are the inputs after the residual."""

    def _run(self, x, w, bias=None, gate=None, bn_scale=None, bn_bias=None, bn_mean=None, bn_var=None,
             residual_map=None, *tail_operands, **attributes):
        return (conv_epilogue("Conv", x, w, bias, gate, (bn_scale, bn_bias, bn_mean, bn_var), residual_map,
                              tail_operands, attributes),)


class ConvTransposeEpilogue(_FusedOp):
    """ConvTranspose + bias + inference BatchNormalization + activation + residual + activation + tail."""

    def _run(self, x, w, bias=None, bn_scale=None, bn_bias=None, bn_mean=None, bn_var=None,
             residual_map=None, *tail_operands, **attributes):
        return (conv_epilogue("ConvTranspose", x, w, bias, None, (bn_scale, bn_bias, bn_mean, bn_var),
                              residual_map, tail_operands, attributes),)


class SqueezeExcitation(_FusedOp):
    """gate(conv1x1(activation(conv1x1(GlobalAveragePool(x), w1) + b1), w2) + b2), shape (N, C, 1, 1);
    a bias left out ("") is zero."""

    def _run(self, x, w1, b1, w2, b2=None, activation="relu", activation_params=None, gate="hardsigmoid",
             gate_params=None):
        pooled = x.mean(axis=(2, 3))
        hidden = pooled @ w1.reshape(w1.shape[0], -1).T + (0 if b1 is None else b1.reshape(-1))
        hidden = apply_activation(hidden.astype(x.dtype), activation, activation_params)
        out = hidden @ w2.reshape(w2.shape[0], -1).T + (0 if b2 is None else b2.reshape(-1))
        out = apply_activation(out.astype(x.dtype), gate, gate_params)
        return (out.reshape(out.shape + (1, 1)),)


class ResizeMerge(_FusedOp):
    """Inputs flagged in ``resized`` are upsampled (Resize by their 4 ``scales``, in order),
    then ``merge = "add"`` adds the two and applies ``activation``, or ``"concat"`` joins all
    along ``axis``."""

    def _run(self, *inputs, merge="concat", axis=1, resized=None, scales=None, activation="",
             activation_params=None, **resize_attributes):
        maps, scale_list = [], list(scales or [])
        for value, is_resized in zip(inputs, resized or [0] * len(inputs)):
            if is_resized:
                value, scale_list = resize(value, scale_list[:4], resize_attributes), scale_list[4:]
            maps.append(value)
        if merge == "add":
            return (apply_activation(maps[0] + maps[1], activation, activation_params),)
        return (np.concatenate(maps, axis=axis),)


class Attention(_FusedOp):
    """softmax(scale * Q·Kᵀ, causal Where, + mask)·V with heads split and merged.

    ``qk_form``: "projections" (query, key, value are [B, S, H*D] projections), "packed" (query
    is one [B, S, 3*H*D] projection split by ``qkv_split`` along the last axis), "stacked" (query
    is one projection viewed as ``qkv_shape`` [B, S, 3, H, D], Q, K, V its slices on axis 2),
    "heads" (query and key already [B, H, S, D]). Where ``causal_condition`` is false the score
    becomes ``causal_fill``; ``mask`` is added; with ``nan_fill``, NaN probabilities (rows
    masked everywhere) become it. The [B, S, H, D] result is reshaped to ``output_shape``.
    """

    def _run(self, query, key=None, value=None, causal_condition=None, mask=None, num_heads=1,
             qk_form="projections", qkv_split=None, qkv_shape=None, scale=1.0, causal_fill=0.0, nan_fill=None,
             output_shape=None):
        if qk_form == "stacked":
            query, key, value = query.reshape(qkv_shape).transpose(2, 0, 3, 1, 4)
        elif qk_form == "packed":
            query, key, value = np.split(query, np.cumsum(qkv_split)[:-1], axis=-1)
        if qk_form not in ("heads", "stacked"):
            query, key = _heads(query, num_heads), _heads(key, num_heads)
        value = value if qk_form == "stacked" else _heads(value, num_heads)
        with np.errstate(over="ignore", invalid="ignore"):  # -3.4e38 masks add up to -inf, as in ORT
            scores = (query @ np.swapaxes(key, -1, -2)) * np.float32(scale)
            if causal_condition is not None:
                scores = np.where(causal_condition, scores, np.float32(causal_fill))
            probs = softmax(scores if mask is None else scores + mask).astype(query.dtype)
        probs = probs if nan_fill is None else np.where(np.isnan(probs), np.float32(nan_fill), probs)
        merged = (probs @ value).transpose(0, 2, 1, 3)
        return (merged.reshape(output_shape) if output_shape is not None else merged,)


def _heads(projection: np.ndarray, num_heads: int) -> np.ndarray:
    """[B, S, H*D] -> [B, H, S, D]."""
    batch, sequence, width = projection.shape
    return projection.reshape(batch, sequence, num_heads, width // num_heads).transpose(0, 2, 1, 3)


class FusedSoftmax(_FusedOp):
    """epilogue(softmax(x * scale, causal Where, + mask)): ``epilogue`` "multiply" (by
    ``epilogue_operand``) or "cast" (to ``to``)."""

    def _run(self, x, causal_condition=None, mask=None, epilogue_operand=None, scale=1.0, causal_fill=0.0,
             axis=-1, epilogue="", to=0):
        logits = x * np.float32(scale) if scale != 1.0 else x
        if causal_condition is not None:
            logits = np.where(causal_condition, logits, np.float32(causal_fill))
        if mask is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                logits = logits + mask
        out = softmax(logits, axis).astype(x.dtype)
        if epilogue == "multiply":
            out = out * epilogue_operand
        elif epilogue == "cast":
            out = out.astype(helper.tensor_dtype_to_np_dtype(to))
        return (out,)


class SkipLayerNorm(_FusedOp):
    """LayerNorm(input + bias + skip) over the axes from ``axis`` on; second output the sum."""

    def _run(self, x, skip, gamma, beta=None, bias=None, epsilon=1e-5, axis=-1):
        summed = (x + bias if bias is not None else x) + skip
        return layer_norm(summed, gamma, beta, epsilon, axis), summed


class SkipRMSNorm(_FusedOp):
    """RMSNorm(input + bias + skip) = s / sqrt(mean(s²) + epsilon) * gamma; second output the sum."""

    def _run(self, x, skip, gamma=None, bias=None, epsilon=1e-6, axis=-1):
        summed = (x + bias if bias is not None else x) + skip
        return rms_norm(summed, gamma, epsilon, axis), summed


class LayerNorm(_FusedOp):
    """A LayerNorm the exporter decomposed (below opset 17), as one op."""

    def _run(self, x, gamma=None, beta=None, epsilon=1e-5, axis=-1):
        return (layer_norm(x, 1 if gamma is None else gamma, beta, epsilon, axis),)


class RMSNorm(_FusedOp):
    """An RMSNorm the exporter decomposed (no RMSNormalization below opset 23), as one op."""

    def _run(self, x, gamma=None, epsilon=1e-6, axis=-1):
        return (rms_norm(x, gamma, epsilon, axis),)


class Activation(_FusedOp):
    """An activation the exporter decomposed (erf or tanh GELU, SiLU, HardSwish, ...), as one op."""

    def _run(self, x, activation="", activation_params=None):
        return (apply_activation(x, activation, activation_params),)


class AddEyeLike(_FusedOp):
    """other + EyeLike(x, k): ones where column - row == k, in ``dtype`` (0: x's)."""

    def _run(self, x, other, k=0, dtype=0):
        rows, columns = x.shape
        eye = np.eye(rows, columns, k, dtype=helper.tensor_dtype_to_np_dtype(dtype) if dtype else x.dtype)
        return ((other + eye).astype(other.dtype),)


FUSED_OPS = [GemmEpilogue, GemmDropout, ConvEpilogue, ConvTransposeEpilogue, SqueezeExcitation, ResizeMerge,
             Attention, FusedSoftmax, SkipLayerNorm, SkipRMSNorm, LayerNorm, RMSNorm, Activation, AddEyeLike]


def evaluator(model) -> ReferenceEvaluator:
    """A ReferenceEvaluator for a fused model: the standard ops (``STANDARD_FIXES`` where
    onnx.reference departs from ONNX Runtime) plus ours."""
    return ReferenceEvaluator(model, new_ops=FUSED_OPS + STANDARD_FIXES)
