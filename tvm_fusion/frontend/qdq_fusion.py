"""QDQ groups (DequantizeLinear inputs -> op -> QuantizeLinear) rewritten as the QOperator op
ONNX Runtime runs in their place.

``quantize_static`` (and torch/tf exporters) write quantized models as QDQ: float ops between
DequantizeLinear and QuantizeLinear. ONNX Runtime's optimizer (on by default) replaces each such
group of a Conv, MatMul, Gemm, Add or Mul by QLinearConv, QLinearMatMul, QGemm, QLinearAdd or
QLinearMul (and of a Sigmoid, LeakyRelu, AveragePool, GlobalAveragePool, Softmax or Concat
by its ``com.microsoft`` QLinear op: ``qlinear_lookup.py``), whose integer arithmetic rounds
differently from the float ops: the quantized values then differ by a step here and there, and
a step is a whole scale of error after it (0.06 on bert-tiny, 6.8 on MiniLM; bert-tiny's two
Softmax groups alone 0.09). So we run the same groups as the same ops (``qoperator.py``
reproduces ONNX Runtime's arithmetic); the rest of the graph keeps its QuantizeLinear and
DequantizeLinear, which already round as ONNX Runtime does.

A group is rewritten where ONNX Runtime's would be: every data input of the op comes from a
DequantizeLinear with constant scale and zero point (a per-channel one only on the weights'
output-channel axis), the op's only reader is a QuantizeLinear with constant scale and zero
point, and the op's output is no graph output.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_MS = "com.microsoft"
# op -> (data inputs that must be dequantized, None: all of them; the weights' per-channel axis
# by input index, a Gemm's is 0 with transB, else 1)
_UNARY = ("Sigmoid", "LeakyRelu", "AveragePool", "GlobalAveragePool", "Softmax")
_GROUPS = {"Conv": (2, {1: 0}), "MatMul": (2, {1: 1}), "Gemm": (2, {1: 1}), "Add": (2, {}), "Mul": (2, {}),
           **{op: (1, {}) for op in _UNARY}, "Concat": (None, {})}
_INTEGER_TYPES = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)


def fuse_qdq_groups(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its QDQ groups as QOperator nodes (the model itself when it has none)."""
    graph = model.graph
    if not any(node.op_type == "DequantizeLinear" for node in graph.node):
        return model
    constants = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    rewritten, replaced = [], {}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    for node in graph.node:
        fused = _fused(node, constants, producers, readers, outputs, opset)
        if fused is not None:
            quantize = readers[node.output[0]][0]
            replaced[id(quantize)] = fused
            replaced[id(node)] = None
    if not replaced:
        return model
    for node in graph.node:
        if id(node) not in replaced:
            rewritten.append(node)
        elif replaced[id(node)] is not None:
            rewritten.append(replaced[id(node)])
    fused_model = onnx.ModelProto()
    fused_model.CopyFrom(model)
    del fused_model.graph.node[:]
    fused_model.graph.node.extend(_without_dead_dequantize(rewritten, outputs))
    if not any(opset.domain == _MS for opset in fused_model.opset_import):
        fused_model.opset_import.append(helper.make_opsetid(_MS, 1))
    return fused_model


def _fused(node, constants, producers, readers, outputs, opset: int) -> onnx.NodeProto | None:
    """The QOperator node for ``node``'s group, or None where ONNX Runtime keeps it float."""
    group = _GROUPS.get(node.op_type)
    if group is None or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
        return None
    count, channel_axes = group
    count = len(node.input) if count is None else count
    if node.op_type == "Gemm" and any(attr.name == "transB" and attr.i for attr in node.attribute):
        channel_axes = {1: 0}
    after = readers.get(node.output[0], [])
    if len(after) != 1 or after[0].op_type != "QuantizeLinear" or not _constant_parameters(after[0], constants, None):
        return None
    quantize = after[0]
    dequantized = []
    for index in range(count):
        source = producers.get(node.input[index]) if index < len(node.input) else None
        if source is None or source.op_type != "DequantizeLinear" or not _constant_parameters(
                source, constants, channel_axes.get(index)):
            return None
        dequantized.append(source)
    types = [_element_type(source.input[0], source, constants) for source in dequantized]
    output_type = _element_type(quantize.output[0], quantize, constants)
    if any(t not in _INTEGER_TYPES for t in types) or output_type != types[0]:
        return None
    x, *rest = ([source.input[0], source.input[1], _zero_point_name(source)] for source in dequantized)
    y = [quantize.input[1], _zero_point_name(quantize)]
    attributes = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
    if count == 1 or node.op_type == "Concat":
        if node.op_type == "Softmax":  # the version of Softmax's schema: which axes it normalizes
            attributes["opset"] = 13 if opset >= 13 else 11 if opset >= 11 else 1
        return _unary_or_concat(node, x, rest, y, types, quantize, attributes)
    w = rest[0]
    if node.op_type in ("Add", "Mul"):
        if types[1] != types[0]:
            return None
        return helper.make_node(f"QLinear{node.op_type}", [*x, *w, *y], list(quantize.output), name=node.name,
                                domain=_MS)
    if node.op_type == "MatMul":
        return helper.make_node("QLinearMatMul", [*x, *w, *y], list(quantize.output), name=node.name)
    bias = _integer_bias(node, producers, constants)
    if bias is None:
        return None
    if node.op_type == "Conv":
        return helper.make_node("QLinearConv", [*x, *w, *y] + ([bias] if bias else []), list(quantize.output),
                                name=node.name, **attributes)
    if attributes.get("beta", 1.0) != 1.0:
        return None
    attributes.pop("beta", None)
    return helper.make_node("QGemm", [*x, *w, bias, *y], list(quantize.output), name=node.name, domain=_MS,
                            **attributes)


def _unary_or_concat(node, x, rest, y, types, quantize, attributes) -> onnx.NodeProto | None:
    """com.microsoft QLinearSigmoid/LeakyRelu/AveragePool/GlobalAveragePool/Softmax (``x, y``), or
    QLinearConcat (``y`` first, then each input's triple), ONNX Runtime's unary and variadic
    rewrites; None where its op would not take the attributes."""
    if node.op_type == "Concat":
        if len(set(types)) != 1:
            return None
        inputs = [*y, *x, *(name for triple in rest for name in triple)]
    else:
        inputs = [*x, *y]
    if node.op_type == "AveragePool" and (any(d != 1 for d in attributes.pop("dilations", [])) or
                                          attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")):
        return None
    return helper.make_node(f"QLinear{node.op_type}", inputs, list(quantize.output), name=node.name, domain=_MS,
                            **attributes)


def _integer_bias(node, producers, constants) -> str | None:
    """The int32 bias of a Conv or Gemm (its third input dequantized with zero point 0), "" when
    there is none, None when it is another tensor (the group then stays float)."""
    if len(node.input) < 3 or not node.input[2]:
        return ""
    source = producers.get(node.input[2])
    if source is None or source.op_type != "DequantizeLinear" or source.input[0] not in constants:
        return None
    if constants[source.input[0]].data_type != onnx.TensorProto.INT32:
        return None
    zero = _zero_point_name(source)
    if zero and (zero not in constants or np.any(numpy_helper.to_array(constants[zero]) != 0)):
        return None
    return source.input[0]


def _constant_parameters(node, constants, channel_axis: int | None) -> bool:
    """Constant scale and zero point: one for the tensor, or (``channel_axis`` given) one per
    channel along that axis."""
    names = [node.input[1]] + ([node.input[2]] if len(node.input) > 2 and node.input[2] else [])
    if any(name not in constants for name in names):
        return False
    sizes = {numpy_helper.to_array(constants[name]).size for name in names}
    if sizes == {1}:
        return True
    if channel_axis is None or any(attr.name == "block_size" and attr.i for attr in node.attribute):
        return False
    return _axis(node) == channel_axis or _axis(node) is None and channel_axis == 1


def _axis(node) -> int | None:
    return next((attr.i for attr in node.attribute if attr.name == "axis"), None)


def _zero_point_name(node) -> str:
    return node.input[2] if len(node.input) > 2 else ""


def _element_type(name, node, constants) -> int | None:
    """The integer type of a quantized tensor: its zero point's (uint8 when there is none)."""
    zero = _zero_point_name(node)
    if zero:
        return constants[zero].data_type if zero in constants else None
    return onnx.TensorProto.UINT8


def _without_dead_dequantize(nodes: list, outputs: set) -> list:
    """``nodes`` less the DequantizeLinear nodes nothing reads any more."""
    read = {name for node in nodes for name in node.input} | outputs
    return [node for node in nodes if node.op_type != "DequantizeLinear" or node.output[0] in read]
