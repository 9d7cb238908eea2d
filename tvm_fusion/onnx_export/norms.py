"""How the fused norms read the normalization in their nodes (``norm_region``), whether the model
has a LayerNormalization / RMSNormalization node or the ReduceMean, Sub, Pow, Sqrt, Div chain
exporters write below opset 17 / 23: shared by the skip norms (``fusions/skip_layernorm.py``)
and the decomposed ones (``fusions/layernorm_decomposed.py``).
"""

from __future__ import annotations

from .graph import Region, Unrepresentable, attribute


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
