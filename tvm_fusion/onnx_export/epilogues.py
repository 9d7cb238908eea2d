"""Builders for the fusions around one anchor op and its epilogue: matmul (``GemmEpilogue``,
``GemmDropout``), conv and conv-transpose (``ConvEpilogue``, ``ConvTransposeEpilogue``), the
squeeze-excitation block and the FPN's resize-and-merge.

Each reads its anchor, then places the chain after it (``chains.chain_steps``) stage by
stage in the order the kernel computes them; anything out of that order goes to the tail or
makes the fusion ``Unrepresentable``.
"""

from __future__ import annotations

import onnx

from ..onnx_ops_standard import RESIZE_ATTRIBUTES
from .chains import Step, Tail, activation_attributes, chain_steps, check_all_used, is_residual, variant_parts
from .graph import GraphIndex, Region, Unrepresentable, attribute, fused_node, node_attributes


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


def resize_attributes(graph: GraphIndex, resizes: list[onnx.NodeProto]) -> dict:
    """The Resize attributes, prefixed ``resize_``, shared by every Resize in the fusion."""
    found = {tuple(sorted((k, str(v)) for k, v in node_attributes(node).items())) for node in resizes}
    if len(found) > 1:
        raise Unrepresentable("the fused Resizes differ in their attributes")
    attrs = node_attributes(resizes[0])
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise Unrepresentable("Resize with tf_crop_and_resize reads a region of interest")
    return {f"resize_{k}": v for k, v in attrs.items() if k in RESIZE_ATTRIBUTES}


def resize_scales(graph: GraphIndex, resize: onnx.NodeProto) -> list[float]:
    """The Resize's scales input, or output / input size when it was given sizes."""
    scales = graph.constants.get(resize.input[2]) if len(resize.input) > 2 and resize.input[2] else None
    if scales is not None and scales.size:
        return [float(s) for s in scales]
    source, target = graph.shape(resize.input[0]), graph.shape(resize.output[0])
    return [t / s for s, t in zip(source, target)]


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


def build_resize_merge(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Resizes + Add (+ activation) of a lateral map, or Resizes + Concat."""
    graph = region.graph
    merge = region.only("Add", "Concat")
    done = {graph.producer[merge.output[0]]}
    inputs, resized, scales, resizes = [], [], [], []
    for name in merge.input:
        resize = region.producer(name, "Resize")
        if resize is not None:
            done.add(graph.producer[name])
            resizes.append(resize)
            scales += resize_scales(graph, resize)
            name = resize.input[0]
        inputs.append(name)
        resized.append(int(resize is not None))
    attrs = {"merge": "add" if merge.op_type == "Add" else "concat", "resized": resized, "scales": scales}
    if merge.op_type == "Concat":
        attrs["axis"] = attribute(merge, "axis")
    steps, end = chain_steps(region, merge.output[0], done)
    for step in steps:
        if step.kind != "activation" or "activation" in attrs:
            raise Unrepresentable(f"{step.kind} after the merge")
        attrs.update(activation_attributes(step))
    check_all_used(region, done)
    return [fused_node("ResizeMerge", inputs, [end], **attrs, **resize_attributes(graph, resizes))]
