"""Models that compute the same function as the one given with their float operations off by
rounding noise: the reference's own spread, which ``verify`` measures by running ONNX Runtime on
them (its ``REFERENCE_VARIANTS``).

Graph optimizations and thread counts leave ONNX Runtime's sums and quantization scales as they
are, so the noise that matters before a run-time quantization comes only from these models:

* ``halved_reductions``: each float ReduceMean / ReduceSum over its last axis summed in another
  order (a decomposed layer norm's statistics);
* ``nudged_quantization_inputs``: every value that a run-time quantization quantizes moved up by
  one or two units in the last place. A norm in front of one (a LayerNormalization before a
  DynamicQuantizeLSTM) that sums in another order than ONNX Runtime's moves the tensor's max by
  an ulp, so the scale of every product after it, and a recurrent model carries that on.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

# ReduceMean / ReduceSum -> the first opset that takes their axes as an input, not an attribute.
_AXES_INPUT_OPSET = {"ReduceMean": 18, "ReduceSum": 13}

# (domain, op) -> the inputs it quantizes at run time, from a scale and zero point it computes
# from their range: DynamicQuantizeLinear's x, DynamicQuantizeMatMul's A, DynamicQuantizeLSTM's
# X and initial_h (each later step's hidden state is quantized inside it).
RUN_TIME_QUANTIZED_INPUTS = {("", "DynamicQuantizeLinear"): (0,), ("com.microsoft", "DynamicQuantizeMatMul"): (0,),
                             ("com.microsoft", "DynamicQuantizeLSTM"): (0, 5)}
# float32(1 + 2^-23): a product with it rounds to one or two ulps above the value (zero stays).
_ONE_ULP_UP = np.nextafter(np.float32(1), np.float32(2))


def _tensor_types(model: onnx.ModelProto) -> dict | None:
    """The inferred tensor type of each value and graph input, by name; None for a model shape
    inference cannot take (over 2 GB, or invalid), which the rewrites then leave as it is."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError):
        return None
    return {v.name: v.type.tensor_type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}


def halved_reductions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each float ReduceMean / ReduceSum over its last axis (static, even length)
    computed as that reduction of the reductions of the two halves."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    types = _tensor_types(model)
    if types is None:
        return model
    # The reductions' axes inputs only: converting every weight would copy the whole model.
    wanted = {n.input[1] for n in model.graph.node if n.op_type in _AXES_INPUT_OPSET and len(n.input) > 1}
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in wanted}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                      if n.op_type == "Constant" and n.output[0] in wanted and n.attribute[0].name == "value"})
    halved = onnx.ModelProto()
    halved.CopyFrom(model)
    nodes, added, axes = [], [], set()
    for k, node in enumerate(halved.graph.node):
        rank, length = _last_axis_reduction(node, types, constants, opset)
        if not length or length % 2:
            nodes.append(node)
            continue
        axes.update(node.input[1:])
        tag = f"_halved_{k}"
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        added.append(numpy_helper.from_array(np.array([0] * (rank - 1) + [2, length // 2], np.int64), "shape" + tag))
        nodes.append(helper.make_node("Reshape", [node.input[0], "shape" + tag], ["split" + tag]))
        if opset >= _AXES_INPUT_OPSET[node.op_type]:
            added.append(numpy_helper.from_array(np.array([-1], np.int64), "axis" + tag))
            nodes.append(helper.make_node(node.op_type, ["split" + tag, "axis" + tag], ["halves" + tag], keepdims=0))
            nodes.append(helper.make_node(node.op_type, ["halves" + tag, "axis" + tag], node.output, keepdims=keepdims))
        else:
            nodes.append(helper.make_node(node.op_type, ["split" + tag], ["halves" + tag], axes=[-1], keepdims=0))
            nodes.append(helper.make_node(node.op_type, ["halves" + tag], node.output, axes=[-1], keepdims=keepdims))
    unused = axes - {name for node in nodes for name in node.input}  # ONNX Runtime warns of each
    del halved.graph.node[:]
    halved.graph.node.extend(n for n in nodes if not (n.op_type == "Constant" and n.output[0] in unused))
    kept = [i for i in halved.graph.initializer if i.name not in unused]
    del halved.graph.initializer[:]
    halved.graph.initializer.extend(kept + added)
    return halved


def nudged_quantization_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each float32 input of a run-time quantization (RUN_TIME_QUANTIZED_INPUTS)
    multiplied by float32(1 + 2^-23) first; a model without one is returned as it is."""
    if not any((node.domain or "", node.op_type) in RUN_TIME_QUANTIZED_INPUTS for node in model.graph.node):
        return model
    tensors = _tensor_types(model)
    if tensors is None:
        return model
    types = {name: tensor.elem_type for name, tensor in tensors.items()}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    nudged = onnx.ModelProto()
    nudged.CopyFrom(model)
    factor = "one_ulp_up_nudge"
    nodes = []
    for k, node in enumerate(nudged.graph.node):
        for i in RUN_TIME_QUANTIZED_INPUTS.get((node.domain or "", node.op_type), ()):
            source = node.input[i] if i < len(node.input) else ""
            if source and types.get(source) == onnx.TensorProto.FLOAT:
                node.input[i] = f"{source}_nudged_{k}_{i}"
                nodes.append(helper.make_node("Mul", [source, factor], [node.input[i]]))
        nodes.append(node)
    if len(nodes) == len(nudged.graph.node):
        return model
    del nudged.graph.node[:]
    nudged.graph.node.extend(nodes)
    nudged.graph.initializer.append(numpy_helper.from_array(np.array(_ONE_ULP_UP), factor))
    return nudged


def _last_axis_reduction(node: onnx.NodeProto, types: dict, constants: dict, opset: int) -> tuple[int, int]:
    """(rank, length of the last axis) where ``node`` reduces a float tensor over its last axis
    alone and that length is static, else (0, 0)."""
    if node.op_type not in _AXES_INPUT_OPSET or node.domain not in ("", "ai.onnx"):
        return 0, 0
    tensor = types.get(node.input[0])
    if tensor is None or tensor.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) \
            or not tensor.HasField("shape") or not tensor.shape.dim:
        return 0, 0
    if opset >= _AXES_INPUT_OPSET[node.op_type]:
        axes = constants.get(node.input[1]) if len(node.input) > 1 else None
        axes = None if axes is None else axes.reshape(-1).tolist()
    else:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    rank = len(tensor.shape.dim)
    if axes is None or len(axes) != 1 or axes[0] % rank != rank - 1:
        return 0, 0
    return rank, tensor.shape.dim[-1].dim_value  # 0 where the length is symbolic
