"""``ConvEpilogue``: the fused ONNX of ``conv_epilogue``, its builder and its reference
implementation. ``conv_transpose_epilogue`` (``ConvTransposeEpilogue``) and ``conv_bn_fold`` use
the builder too.

The builder reads the Conv/ConvTranspose, then places the chain after it
(``chains.chain_steps``) stage by stage in the order the kernel computes them; anything out of
that order goes to the tail or makes the fusion ``Unrepresentable``.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..chains import Step, Tail, activation_attributes, chain_steps, check_all_used, is_residual, variant_parts
from ..graph import (GraphIndex, Region, Unrepresentable, attribute, fused_node, node_attributes, resize_attributes,
                     resize_scales)
from ..reference_ops import FusedOp, apply_activation, apply_tail, per_channel
from ..spec import OnnxSpec
from ..standard_ops import resize, standard


def build_conv(region: Region, variant: str) -> list[onnx.NodeProto]:
    """[Mul by an SE gate] + Conv/ConvTranspose + bias + BatchNorm (before or after a bias Add;
    or a folded per-channel Mul [+ Add]) + activation + residual (a tensor, or a Resize of a
    small map) + activation."""
    graph = region.graph
    conv = region.only("Conv", "ConvTranspose")
    done = {graph.producer[conv.output[0]]}
    x, gate = conv.input[0], ""
    scale = region.producer(x, "Mul")
    if scale is not None:
        done.add(graph.producer[x])
        first, second = scale.input
        x, gate = (first, second) if graph.shape(second)[2:] == (1, 1) else (second, first)
    bias = conv.input[2] if len(conv.input) > 2 else ""
    attrs = node_attributes(conv)
    bn, residual, stage = ["", "", "", ""], "", 0  # 0 conv, 1 bn, 2 bias add, 3 act, 4 residual, 5 post
    tail = Tail(region, variant, "conv")
    steps, end = chain_steps(region, conv.output[0], done)
    for step in tail.before(steps):
        if step.kind == "BatchNormalization" and stage in (0, 2) and not bn[0]:  # BN(conv + bias), as the op
            if attribute(step.nodes[0], "training_mode", 0):
                raise Unrepresentable("BatchNormalization in training mode")
            bn, stage = list(step.nodes[0].input[1:5]), max(stage, 1)
            attrs["epsilon"] = attribute(step.nodes[0], "epsilon", 1e-5)
        elif step.kind == "Mul" and stage in (0, 2) and not bn[0] and not tail.allowed:
            # Only conv_affine_fold puts a Mul into a variant without a tail: the scale of a
            # BatchNormalization exported as conv * s + t, written as a BN without mean and var.
            bn[0], stage, attrs["affine"] = per_channel_constant(graph, step), max(stage, 1), 1
        elif step.kind == "add" and attrs.get("affine") and not bn[1] and stage < 3:
            bn[1] = per_channel_constant(graph, step)
        elif (step.kind == "add" and stage < 2 and not bias and not bn[0] and step.operand in graph.constants
              and "bias" in variant_parts(variant)):
            bias, stage = step.operand, 2
        elif step.kind == "activation" and stage < 3:
            attrs.update(activation_attributes(step))
            stage = 3
        elif is_residual(graph, step) and stage < 4:
            residual, stage = step.operand, 4
            resize = region.producer(residual, "Resize")
            attrs["residual"] = "tensor"
            if resize is not None:
                done.add(graph.producer[residual])
                residual = resize.input[0]
                attrs.update(residual="upsampled", **resize_attributes(graph, [resize]),
                             resize_scales=resize_scales(graph, resize))
        elif step.kind == "activation" and stage == 4:
            attrs.update(activation_attributes(step, "post_activation"))
            stage = 5
        else:
            tail.take(step)
    check_all_used(region, done)
    attrs.update(has_bias=int(bool(bias or bn[0])), batch_norm=int(bool(bn[2])), **tail.attributes())
    if conv.op_type == "Conv":
        return [fused_node("ConvEpilogue", [x, conv.input[1], bias, gate, *bn, residual, *tail.operands], [end],
                           scaled=int(bool(gate)), **attrs)]
    return [fused_node("ConvTransposeEpilogue", [x, conv.input[1], bias, *bn, residual, *tail.operands], [end],
                       **attrs)]


def per_channel_constant(graph: GraphIndex, step: Step) -> str:
    """The operand of a step that multiplies or adds a constant per output channel of a conv."""
    value, channels = graph.constants.get(step.operand), graph.shape(step.output)[1]
    if value is None or not (value.size == 1 or value.shape in ((channels, 1, 1), (1, channels, 1, 1))):
        raise Unrepresentable(f"{step.kind} by other than a per-channel constant after the conv")
    return step.operand


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


class ConvEpilogue(FusedOp):
    """Conv (NCHW) with an optional per-channel input scale (SE gate) in front and bias,
    inference BatchNormalization (with ``affine`` = 1, no mean and variance: ``* bn_scale [+
    bn_bias]``), activation, residual add (a tensor, or ``residual = "upsampled"``: the small
    map, resized by ``resize_scales`` first), activation after it and the element-wise
    ``tail`` (``apply_tail``), whose operands are the inputs after the residual."""

    def _run(self, x, w, bias=None, gate=None, bn_scale=None, bn_bias=None, bn_mean=None, bn_var=None,
             residual_map=None, *tail_operands, **attributes):
        return (conv_epilogue("Conv", x, w, bias, gate, (bn_scale, bn_bias, bn_mean, bn_var), residual_map,
                              tail_operands, attributes),)


SPEC = OnnxSpec("conv_epilogue", build_conv, (ConvEpilogue,))
