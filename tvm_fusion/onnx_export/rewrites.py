"""Builders for the rewrites of a few nodes into one op that no fusion absorbed: an activation
an exporter decomposed (``Activation``) and ``EyeLike`` + ``Add`` (``AddEyeLike``).

They are custom ops rather than standard ``Gelu`` (opset 20) or ``HardSwish``: those would need
the model's default opset raised, which changes other ops' signatures.
"""

from __future__ import annotations

import onnx

from .chains import activation_params
from .graph import Region, Unrepresentable, attribute, fused_node

# Rewrites whose result is an activation, and the activation they produce.
ACTIVATION_REWRITES = {"gelu_erf": "gelu", "gelu_tanh": "gelu_tanh", "silu": "silu",
                       "hardswish": "hardswish", "hardsigmoid": "hardsigmoid", "clip": "clip"}


def build_activation_rewrite(region: Region, variant: str) -> list[onnx.NodeProto]:
    graph = region.graph
    sources = {i for node in region.nodes for i in node.input
               if i and region.producer(i) is None and i not in graph.constants}
    if len(sources) != 1 or len(region.outputs) != 1:
        raise Unrepresentable("the activation does not have one input and one output")
    params = []
    if variant == "hardsigmoid":
        params = [1 / 6, 0.5]
    elif variant == "clip":
        params = activation_params(graph, region.only("Clip"))
    return [fused_node("Activation", [sources.pop()], [region.nodes[-1].output[0]],
                       activation=ACTIVATION_REWRITES[variant], **({"activation_params": params} if params else {}))]


def build_add_eye_like(region: Region, variant: str) -> list[onnx.NodeProto]:
    eye = region.only("EyeLike")
    add = region.only("Add")
    other = add.input[1] if add.input[0] == eye.output[0] else add.input[0]
    return [fused_node("AddEyeLike", [eye.input[0], other], [add.output[0]], k=attribute(eye, "k", 0),
                       dtype=attribute(eye, "dtype"))]
