"""``GemmEpilogue``: the fused ONNX of ``gemm_epilogue``, its builder and its reference
implementation. ``flattened_linear`` and ``dropout_training`` (``GemmDropout``) use the builder too.

The builder reads the MatMul/Gemm, then places the chain after it (``chains.chain_steps``)
stage by stage in the order the kernel computes them; anything out of that order goes to the
tail or makes the fusion ``Unrepresentable``.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..chains import Tail, activation_attributes, chain_steps, check_all_used, is_residual, variant_parts
from ..graph import GraphIndex, Region, Unrepresentable, attribute, fused_node
from ..reference_ops import FusedOp, apply_activation, apply_tail
from ..spec import OnnxSpec


def build_gemm(region: Region, variant: str) -> list[onnx.NodeProto]:
    """MatMul/Gemm [+ Reshape of a flattened linear] + bias + activation + residual [+ Dropout]."""
    graph = region.graph
    matmul = region.only("MatMul", "Gemm")
    done = {graph.producer[matmul.output[0]]}
    a, b = matmul.input[0], matmul.input[1]
    flatten = region.producer(a, "Reshape")
    if flatten is not None:
        a = flatten.input[0]
        done.add(graph.producer[flatten.output[0]])
    if attribute(matmul, "transA", 0):
        raise Unrepresentable("Gemm with transA")
    attrs = {"trans_b": attribute(matmul, "transB", 0), "alpha": attribute(matmul, "alpha", 1.0),
             "beta": attribute(matmul, "beta", 1.0)}
    bias = matmul.input[2] if len(matmul.input) > 2 and matmul.input[2] else ""
    residual, act, dropout = "", None, None
    output_shape = graph.shape(matmul.output[0])
    stage = 0  # 0 matmul, 1 bias, 2 activation, 3 residual, 4 dropout
    tail = Tail(region, variant, "matmul")
    steps, end = chain_steps(region, matmul.output[0], done)
    for step in tail.before(steps):
        if step.kind == "Reshape" and stage == 0:
            output_shape = graph.shape(step.output)
        elif step.kind == "add" and stage == 0 and not bias and "bias" in variant_parts(variant):
            bias, stage = step.operand, 1
        elif step.kind == "activation" and stage < 2:
            act, stage = step, 2
        elif is_residual(graph, step) and stage < 3:
            residual, stage = step.operand, 3
        elif step.kind == "Dropout" and stage < 4:
            dropout, stage = step.nodes[0], 4
        else:
            tail.take(step)
    check_all_used(region, done)
    attrs.update(activation_attributes(act) if act else {})
    attrs.update(output_shape=list(output_shape), has_bias=int(bool(bias)))
    if dropout is not None:
        return [fused_node("GemmDropout", [a, b, bias], [o for o in dropout.output if o],
                           ratio=dropout_ratio(graph, dropout), seed=dropout_seed(graph, dropout), **attrs)]
    return [fused_node("GemmEpilogue", [a, b, bias, residual, *tail.operands], [end],
                       has_residual=int(bool(residual)), **attrs, **tail.attributes())]


def dropout_ratio(graph: GraphIndex, node: onnx.NodeProto) -> float:
    ratio = graph.scalar(node.input[1]) if len(node.input) > 1 and node.input[1] else 0.5
    if ratio is None:
        raise Unrepresentable("the dropout ratio is computed at run time")
    return ratio


def dropout_seed(graph: GraphIndex, node: onnx.NodeProto) -> int:
    """The Dropout's seed; unseeded ones are numbered in graph order, as the frontend numbers them."""
    seed = attribute(node, "seed")
    if seed is not None:
        return int(seed)
    unseeded = [n for n in graph.nodes if n.op_type == "Dropout" and attribute(n, "seed") is None]
    return unseeded.index(node)


class GemmEpilogue(FusedOp):
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


SPEC = OnnxSpec("gemm_epilogue", build_gemm, (GemmEpilogue,))
