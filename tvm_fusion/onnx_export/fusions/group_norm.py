"""``GroupNorm``: the fused ONNX of ``group_norm`` (a GroupNorm as exporters write it), its builder
and its reference implementation.

A custom op rather than standard ``GroupNormalization``: that needs opset 18, and its scale and
bias are per group until opset 21, while the model's gamma and beta are per channel.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..graph import GraphIndex, Region, Unrepresentable, attribute, fused_node
from ..norms import norm_region
from ..reference_ops import FusedOp, per_channel
from ..spec import OnnxSpec


def build_group_norm(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Reshape (N, C, ... -> N, G, -1) + InstanceNormalization (scale 1, bias 0; or the decomposed
    chain over the view's last axis) + Reshape back [+ Mul gamma + Add beta]."""
    graph = region.graph
    views = [node for node in region.nodes if node.op_type == "Reshape"]
    if len(views) != 2:
        raise Unrepresentable(f"expected a Reshape to the grouped view and one back, found {len(views)} Reshapes")
    grouped, restored = views
    x = grouped.input[0]
    shape, view = graph.shape(x), graph.shape(grouped.output[0])
    if len(shape) < 3 or len(view) != 3 or view[0] != shape[0] or shape[1] % view[1]:
        raise Unrepresentable(f"the view {view} of {shape} is not (N, groups, -1)")
    if graph.shape(restored.output[0]) != shape:
        raise Unrepresentable("the normalized view is not reshaped back to the input's shape")
    restored_at = graph.producer[restored.output[0]]
    norm = [graph.nodes[i] for i in region.indices if graph.producer[grouped.output[0]] < i < restored_at]
    epsilon = view_norm_epsilon(region, norm, grouped.output[0])
    output, affine = restored.output[0], {"Mul": "", "Add": ""}
    for op_type in affine:  # torch writes Mul(gamma) then Add(beta), each per channel
        readers = [graph.nodes[i] for i in region.inside_consumers(output, set())]
        if not readers:
            break
        if len(readers) != 1 or readers[0].op_type != op_type:
            raise Unrepresentable(f"{'/'.join(n.op_type for n in readers)} after the group norm, not {op_type}")
        operand = next(name for name in readers[0].input if name != output)
        per_channel_shapes = ((shape[1],) + (1,) * (len(shape) - 2), (1, shape[1]) + (1,) * (len(shape) - 2))
        if graph.shape(operand) not in per_channel_shapes:
            raise Unrepresentable(f"the {op_type} after the group norm is not by one value per channel")
        affine[op_type], output = operand, readers[0].output[0]
    if output != region.nodes[-1].output[0]:
        raise Unrepresentable("nodes after the group norm's affine")
    return [fused_node("GroupNorm", [x, affine["Mul"], affine["Add"]], [output], num_groups=view[1],
                       epsilon=epsilon)]


def view_norm_epsilon(region: Region, nodes: list[onnx.NodeProto], view: str) -> float:
    """The epsilon of the norm over the view's last axis, which must have scale 1 and bias 0."""
    graph = region.graph
    instance_norms = [node for node in nodes if node.op_type == "InstanceNormalization"]
    if instance_norms:
        node = instance_norms[0]
        if len(nodes) != 1 or node.input[0] != view:
            raise Unrepresentable("the InstanceNormalization of the view is not alone between the reshapes")
        unit_scale_and_bias(graph, node.input[1], node.input[2], "InstanceNormalization")
        return attribute(node, "epsilon", 1e-5)
    (kind, _, _, epsilon, axis, _), source = norm_region(Region(graph, [graph.producer[n.output[0]] for n in nodes]))
    if kind != "layer" or source != view or axis != -1:
        raise Unrepresentable("the decomposed norm is not an instance norm of the view")
    for node in nodes:  # the decomposed instance norm's scale and bias, where written, are 1 and 0
        constant = next((i for i in node.input if i in graph.constants), "")
        of_statistic = any(region.producer(i, "ReduceMean") for i in node.input)  # the variance + eps
        if node.op_type in ("Mul", "Add") and constant and not of_statistic:
            scale_and_bias = (constant, "") if node.op_type == "Mul" else ("", constant)
            unit_scale_and_bias(graph, *scale_and_bias, "instance norm")
    return epsilon


def unit_scale_and_bias(graph: GraphIndex, scale: str, bias: str, what: str) -> None:
    """The norm of the view must have scale 1 and bias 0 (names of constants; "": not written)."""
    for name, role, expected in ((scale, "scale", 1.0), (bias, "bias", 0.0)):
        value = graph.constants.get(name) if name else np.full(1, expected)
        if value is None or not np.allclose(value, expected, rtol=0, atol=1e-6):
            raise Unrepresentable(f"the {what}'s {role} is not {expected:g} (an affine per group)")


class GroupNorm(FusedOp):
    """x (N, C, ...) normalized over each of ``num_groups`` groups of C / num_groups channels and all
    positions, then * gamma + beta per channel (C values each, in any shape; absent: 1 and 0)."""

    def _run(self, x, gamma=None, beta=None, num_groups=1, epsilon=1e-5):
        grouped = x.reshape(x.shape[0], num_groups, -1)
        mean = grouped.mean(axis=-1, keepdims=True)
        variance = ((grouped - mean) ** 2).mean(axis=-1, keepdims=True)
        out = ((grouped - mean) / np.sqrt(variance + epsilon)).reshape(x.shape)
        if gamma is not None:
            out = out * per_channel(gamma.reshape(-1), x.ndim)
        if beta is not None:
            out = out + per_channel(beta.reshape(-1), x.ndim)
        return (out.astype(x.dtype),)


SPEC = OnnxSpec("group_norm", build_group_norm, (GroupNorm,))
