"""``SqueezeExcitation``: the fused ONNX of ``squeeze_excitation``, its builder and its reference."""

from __future__ import annotations

import onnx

from ..chains import activation_attributes, chain_steps, check_all_used
from ..graph import Region, Unrepresentable, fused_node
from ..reference_ops import FusedOp, apply_activation
from ..spec import OnnxSpec


def build_squeeze_excitation(region: Region, variant: str) -> list[onnx.NodeProto]:
    """GlobalAveragePool -> Conv [+ bias] -> activation -> Conv [+ bias] -> gate (a bias left
    out is the empty input name)."""
    graph = region.graph
    pool = region.only("GlobalAveragePool", "ReduceMean")
    done = {graph.producer[pool.output[0]]}
    weights, acts, pending_conv = [], [], None
    steps, end = chain_steps(region, pool.output[0], done)
    for step in steps:
        if step.kind == "Conv" and pending_conv is None and len(weights) < 2:
            node = step.nodes[0]
            pending_conv = node
            weights.append([node.input[1], node.input[2] if len(node.input) > 2 else ""])
        elif step.kind == "add" and pending_conv is not None and not weights[-1][1]:
            weights[-1][1] = step.operand
        elif step.kind == "activation" and pending_conv is not None:
            acts.append(step)
            pending_conv = None
        else:
            raise Unrepresentable(f"{step.kind} in the squeeze-excitation block")
    check_all_used(region, done)
    if len(weights) != 2 or len(acts) != 2:
        raise Unrepresentable("not two 1x1 convs, each followed by an activation")
    return [fused_node("SqueezeExcitation", [pool.input[0], *weights[0], *weights[1]], [end],
                       **activation_attributes(acts[0]), **activation_attributes(acts[1], "gate"))]


class SqueezeExcitation(FusedOp):
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


SPEC = OnnxSpec("squeeze_excitation", build_squeeze_excitation, (SqueezeExcitation,))
