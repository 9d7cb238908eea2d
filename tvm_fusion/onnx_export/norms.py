"""Builders for normalizations: the skip-connection norms (``SkipLayerNorm``, ``SkipRMSNorm``)
and the norms an exporter decomposed, rewritten as one op (``LayerNorm``, ``RMSNorm``).

Both read the normalization the same way (``norm_region``), whether the model has a
LayerNormalization / RMSNormalization node or the ReduceMean, Sub, Pow, Sqrt, Div chain
exporters write below opset 17 / 23.
"""

from __future__ import annotations

import onnx

from .graph import Region, Unrepresentable, attribute, fused_node


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


def norm_region(region: Region) -> tuple[tuple, str]:
    """((kind, gamma, beta, epsilon, axis, output), normalized input) of the normalization.

    A LayerNormalization / RMSNormalization node, or the decomposed forms exporters write below
    opset 17 / 23 (ReduceMean, Sub, Pow, Add eps, Sqrt, Div, Mul gamma [, Add beta], casts).
    """
    graph = region.graph
    for node in region.nodes:
        if node.op_type in ("LayerNormalization", "RMSNormalization"):
            inputs = [*node.input, "", ""]
            kind = "layer" if node.op_type == "LayerNormalization" else "rms"
            return ((kind, inputs[1], inputs[2] if kind == "layer" else "",
                     attribute(node, "epsilon", 1e-5), attribute(node, "axis", -1), node.output[0]),
                    node.input[0])
    means = [n for n in region.nodes if n.op_type == "ReduceMean"]
    if not means:
        raise Unrepresentable("no normalization among the fused nodes")
    first_mean = means[0]
    source = first_mean.input[0]
    centered = [n for n in region.nodes if n.op_type == "Sub" and source in n.input]
    if not centered:  # RMS: the first mean is over a square of the input
        square = region.producer(source)
        source = square.input[0] if square is not None else source
        while (cast := region.producer(source, "Cast")) is not None:
            source = cast.input[0]
    eps_add = next((n for n in region.nodes if n.op_type == "Add" and any(
        region.producer(i, "ReduceMean") is not None for i in n.input)), None)
    epsilon = next((graph.scalar(i) for i in (eps_add.input if eps_add else []) if graph.scalar(i) is not None),
                   None)
    if epsilon is None:
        raise Unrepresentable("no constant epsilon in the decomposed normalization")
    axes = attribute(first_mean, "axes")
    if axes is None and len(first_mean.input) > 1:
        axes = [int(a) for a in graph.constants[first_mean.input[1]].ravel()]
    rank = len(graph.shape(source))
    axes = sorted(a % rank for a in axes or [])
    if axes != list(range(rank - len(axes), rank)) or not axes:
        raise Unrepresentable(f"normalizes over axes {axes}, not trailing ones")
    affine = {op: "" for op in ("Mul", "Add")}
    for node in region.nodes:
        if node.op_type in affine and node is not eps_add:
            external = [i for i in node.input if region.producer(i) is None and graph.scalar(i) is None
                        and i != source]
            if external:
                affine[node.op_type] = external[0]
    output = region.nodes[-1].output[0]
    return (("layer" if centered else "rms", affine["Mul"], affine["Add"], epsilon, axes[0] - rank, output),
            source)


def build_norm_rewrite(region: Region, variant: str) -> list[onnx.NodeProto]:
    (kind, gamma, beta, epsilon, axis, output), source = norm_region(region)
    if kind == "layer":
        return [fused_node("LayerNorm", [source, gamma, beta], [output], epsilon=epsilon, axis=axis)]
    return [fused_node("RMSNorm", [source, gamma], [output], epsilon=epsilon, axis=axis)]
