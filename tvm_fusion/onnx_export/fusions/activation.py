"""``Activation``: the fused ONNX op of the rewrites whose result is one activation an exporter
decomposed (``gelu_erf``, ``gelu_tanh``, ``silu``, ``hardswish``, ``hardsigmoid``, ``clip``, each
with a module of its own that says which activation), its builder and its reference implementation.

A custom op rather than standard ``Gelu`` (opset 20) or ``HardSwish``: those would need the
model's default opset raised, which changes other ops' signatures.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from ..chains import activation_params
from ..graph import Region, Unrepresentable, fused_node
from ..reference_ops import FusedOp, apply_activation


def activation_builder(activation: str, params: Sequence[float] = ()):
    """The builder of a rewrite into ``activation`` (with these ``params``; a clip reads its
    bounds from the Clip node): one ``Activation`` node from the chain's input to its output."""

    def build_activation(region: Region, variant: str) -> list[onnx.NodeProto]:
        graph = region.graph
        sources = {i for node in region.nodes for i in node.input
                   if i and region.producer(i) is None and i not in graph.constants}
        if len(sources) != 1 or len(region.outputs) != 1:
            raise Unrepresentable("the activation does not have one input and one output")
        values = activation_params(graph, region.only("Clip")) if activation == "clip" else list(params)
        return [fused_node("Activation", [sources.pop()], [region.nodes[-1].output[0]],
                           activation=activation, **({"activation_params": values} if values else {}))]

    return build_activation


class Activation(FusedOp):
    """An activation the exporter decomposed (erf or tanh GELU, SiLU, HardSwish, ...), as one op."""

    def _run(self, x, activation="", activation_params=None):
        return (apply_activation(x, activation, activation_params),)
