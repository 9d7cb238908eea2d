"""``SkipLayerNorm``: the fused ONNX of ``skip_layernorm``, its builder and its reference
implementation. ``skip_rms_norm`` (``SkipRMSNorm``, the same rule around rms_norm) uses the builder too."""

from __future__ import annotations

import onnx

from ..graph import Region, Unrepresentable, attribute, fused_node
from ..norms import norm_region
from ..reference_ops import FusedOp, layer_norm
from ..spec import OnnxSpec


def build_skip_norm(region: Region, variant: str) -> list[onnx.NodeProto]:
    """(input + bias) + skip, normalized; the sum as a second output when it is read elsewhere.

    Where the bias is a Gemm's (a flattened linear), the matmul is not part of the fusion: it
    is written back as the original Reshape -> Gemm -> Reshape without the bias.
    """
    graph = region.graph
    norm_nodes, summed = norm_region(region)
    outer = region.producer(summed, "Add")
    if outer is None:
        raise Unrepresentable("the normalized tensor is not a sum")
    inner = next((n for n in map(region.producer, outer.input) if n is not None and n.op_type == "Add"), None)
    x, skip = outer.input
    bias, extra = "", []
    if inner is not None:
        skip = outer.input[1] if inner.output[0] == outer.input[0] else outer.input[0]
        x, bias = inner.input
        if bias not in graph.constants or (x in graph.constants and bias not in graph.constants):
            x, bias = bias, x
    else:
        linear = next((n for n in map(region.producer, outer.input) if n is not None), None)
        if linear is not None:
            extra, x, bias = without_bias(region, linear)
            skip = outer.input[1] if linear.output[0] == outer.input[0] else outer.input[0]
    kind, gamma, beta, epsilon, axis, output = norm_nodes
    outputs = [output] + ([summed] if summed in region.outputs else [])
    if set(region.outputs) - set(outputs):
        raise Unrepresentable("an intermediate sum is also read outside the fusion")
    if kind == "layer":
        node = fused_node("SkipLayerNorm", [x, skip, gamma, beta, bias], outputs, epsilon=epsilon, axis=axis)
    else:
        node = fused_node("SkipRMSNorm", [x, skip, gamma, bias], outputs, epsilon=epsilon, axis=axis)
    return [*extra, node]


def without_bias(region: Region, reshape: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str, str]:
    """Reshape -> Gemm(C) -> Reshape rewritten without C: (nodes, their output, C)."""
    gemm = region.producer(reshape.input[0], "Gemm") if reshape.op_type == "Reshape" else None
    if gemm is None or len(gemm.input) < 3 or attribute(gemm, "beta", 1.0) != 1.0:
        raise Unrepresentable(f"{reshape.op_type} feeding the skip sum is not a flattened linear's bias")
    plain_gemm = onnx.NodeProto()
    plain_gemm.CopyFrom(gemm)
    del plain_gemm.input[2:]
    plain_gemm.output[0] = gemm.output[0] + "/without_bias"
    plain_reshape = onnx.NodeProto()
    plain_reshape.CopyFrom(reshape)
    plain_reshape.input[0] = plain_gemm.output[0]
    plain_reshape.output[0] = reshape.output[0] + "/without_bias"
    flatten = region.producer(gemm.input[0])
    nodes = ([flatten] if flatten is not None else []) + [plain_gemm, plain_reshape]
    return nodes, plain_reshape.output[0], gemm.input[2]


class SkipLayerNorm(FusedOp):
    """LayerNorm(input + bias + skip) over the axes from ``axis`` on; second output the sum."""

    def _run(self, x, skip, gamma, beta=None, bias=None, epsilon=1e-5, axis=-1):
        summed = (x + bias if bias is not None else x) + skip
        return layer_norm(summed, gamma, beta, epsilon, axis), summed


SPEC = OnnxSpec("skip_layernorm", build_skip_norm, (SkipLayerNorm,))
