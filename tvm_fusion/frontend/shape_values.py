"""Shape computations evaluated by ONNX Runtime at the bound shapes, frozen into constants.

Exporters compute pads, reshape targets and slice bounds at run time from ``Shape`` (tf2onnx,
PyTorch's legacy exporter). Once the input shapes are bound these are constants, and onnxslim
folds them, but not always correctly: in a TF-converted OpenNSFW it folds an edge ``Pad``'s
amounts onto the wrong axes, and the simplified model then disagrees with the original. ONNX
Runtime computes those values as the original graph defines them, so every tensor that
depends on the inputs only through their shapes is taken from one ORT run on the original
graph and written in as an initializer before onnxslim sees the model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from .initializers import copy_with_initializers, large_initializers_as_inputs, node_reads, read_initializers

# Ops whose output depends on the input's shape only (not its values).
SHAPE_ONLY = frozenset({"Shape", "Size"})
# Initializers above this size go into shape inference as typed inputs (a constant's values can
# decide a shape only when it is a small shape tensor).
INFERENCE_BYTES = 64 << 10
NOT_DETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                                "Multinomial", "Bernoulli"})


def shape_dependent(model: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """(every tensor computed from shapes and constants alone, those of them that read a shape)."""
    graph = model.graph
    static = {init.name for init in graph.initializer}
    from_shapes: set[str] = set()
    for node in graph.node:  # topologically sorted
        if node.op_type in NOT_DETERMINISTIC or any(attr.type == onnx.AttributeProto.GRAPH for attr in node.attribute):
            continue
        inputs = [name for name in node.input if name]
        if node.op_type in SHAPE_ONLY or node.op_type == "Constant":
            static.update(node.output)
            if node.op_type in SHAPE_ONLY:
                from_shapes.update(node.output)
        elif inputs and all(name in static for name in inputs):
            static.update(node.output)
            if any(name in from_shapes for name in inputs):
                from_shapes.update(node.output)
    return static, from_shapes


def folding_operands(model: onnx.ModelProto) -> frozenset[str]:
    """The initializers a fold may read: those of a node whose inputs are all constant (a slice
    of a position table, a shape of a weight), and any a subgraph reads. The others are only
    ever multiplied with run-time values, so their values cannot matter to a simplification."""
    static, _ = shape_dependent(model)
    names = {init.name for init in model.graph.initializer}
    read = set()
    for node in model.graph.node:
        inputs = [name for name in node.input if name]
        if all(name in static for name in inputs):
            read.update(inputs)
        read.update(name for name in node_reads(node)[len(node.input):])
    return frozenset(read & names)


def shape_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors computed from shapes and constants that a value-dependent node reads (the frontier)."""
    static, from_shapes = shape_dependent(model)
    frontier = []
    outputs = {value.name for value in model.graph.output}
    for node in model.graph.node:
        if all(out in static for out in node.output):
            continue
        frontier += [name for name in node.input if name in from_shapes and name not in frontier]
    return frontier + [name for name in outputs if name in from_shapes and name not in frontier]


def ancestors(model: onnx.ModelProto, names) -> list[onnx.NodeProto]:
    """The nodes ``names`` are computed from, in graph order (an If or Loop also needs what its
    subgraphs read from the outer graph)."""
    producers = {out: index for index, node in enumerate(model.graph.node) for out in node.output if out}
    needed, work = set(), [name for name in names if name in producers]
    while work:
        index = producers[work.pop()]
        if index not in needed:
            needed.add(index)
            work += [name for name in node_reads(model.graph.node[index]) if name in producers]
    return [node for index, node in enumerate(model.graph.node) if index in needed]


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Each computed tensor's ONNX element type, as shape inference finds it."""
    try:  # the weights' values play no part (the inference would copy them twice)
        inferred = onnx.shape_inference.infer_shapes(large_initializers_as_inputs(model, INFERENCE_BYTES)[0])
    except Exception:  # noqa: BLE001 - a graph inference rejects: no types known
        inferred = model
    return {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)}


def evaluate(model: onnx.ModelProto, names: list[str], feeds: list[dict[str, np.ndarray]],
             types: dict[str, int] | None = None) -> list[list] | None:
    """``names`` computed by ONNX Runtime for each feed, running only the nodes they need (a
    branch the bound shapes rule out may fail if run); None when ORT cannot, or a name's
    element type is unknown."""
    types = element_types(model) if types is None else types
    if not all(types.get(name) for name in names):
        return None
    nodes = ancestors(model, names)
    needed = read_initializers(model, nodes)
    probe = copy_with_initializers(model, lambda init: init.name in needed)
    del probe.graph.node[:]
    probe.graph.node.extend(nodes)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, types[name], None) for name in names)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # inputs the pruned probe does not read are expected
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return [session.run(names, feed) for feed in feeds]
    except Exception:  # noqa: BLE001 - ORT cannot run it
        return None


def freeze_shape_tensors(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """``model`` with every ``shape_tensors`` value computed by ONNX Runtime and stored as an
    initializer; unchanged when there are none or ORT cannot run the model.

    ``feeds`` holds one run per size: a model compiled for a range of sizes is probed at its
    low, typical and high sizes, and only the values that are the same at every size are frozen (a head count, a
    hidden width), while those that follow the size (a sequence length) stay computed."""
    types = element_types(model)
    names = [name for name in shape_tensors(model) if types.get(name)]
    runs = evaluate(model, names, feeds, types) if names else None
    if runs is None:
        return model
    constant = [all(np.array_equal(run[i], runs[0][i]) and np.shape(run[i]) == np.shape(runs[0][i])
                    for run in runs) for i in range(len(names))]
    names = [name for name, keep in zip(names, constant) if keep]
    values = [value for value, keep in zip(runs[0], constant) if keep]
    if not names:
        return model
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    frozen.graph.initializer.extend(numpy_helper.from_array(np.asarray(value), name)
                                    for name, value in zip(names, values))
    produced = set(names)
    kept = [node for node in frozen.graph.node if not set(node.output) <= produced]
    for node in kept:  # a node producing one frozen value and others keeps its other outputs
        node.output[:] = [out if out not in produced else "" for out in node.output]
    del frozen.graph.node[:]
    frozen.graph.node.extend(kept)
    return frozen
