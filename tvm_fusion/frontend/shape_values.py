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
from onnx import numpy_helper

# Ops whose output depends on the input's shape only (not its values).
_SHAPE_ONLY = frozenset({"Shape", "Size"})
_NOT_DETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                                "Multinomial", "Bernoulli"})


def shape_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors computed from shapes and constants that a value-dependent node reads (the frontier)."""
    graph = model.graph
    static = {init.name for init in graph.initializer}
    shape_dependent: set[str] = set()
    for node in graph.node:  # topologically sorted
        if node.op_type in _NOT_DETERMINISTIC or any(attr.type == onnx.AttributeProto.GRAPH for attr in node.attribute):
            continue
        inputs = [name for name in node.input if name]
        if node.op_type in _SHAPE_ONLY or node.op_type == "Constant":
            static.update(node.output)
            if node.op_type in _SHAPE_ONLY:
                shape_dependent.update(node.output)
        elif inputs and all(name in static for name in inputs):
            static.update(node.output)
            if any(name in shape_dependent for name in inputs):
                shape_dependent.update(node.output)
    frontier = []
    outputs = {value.name for value in graph.output}
    for node in graph.node:
        if all(out in static for out in node.output):
            continue
        frontier += [name for name in node.input if name in shape_dependent and name not in frontier]
    return frontier + [name for name in outputs if name in shape_dependent and name not in frontier]


def freeze_shape_tensors(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """``model`` with every ``shape_tensors`` value computed by ONNX Runtime and stored as an
    initializer; unchanged when there are none or ORT cannot run the model.

    ``feeds`` holds one run per size: a model compiled for a range of sizes is probed at its
    low, typical and high sizes, and only the values that are the same at every size are frozen (a head count, a
    hidden width), while those that follow the size (a sequence length) stay computed."""
    import onnxruntime as ort

    names = shape_tensors(model)
    if not names:
        return model
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is only for the element types
        inferred = model
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    names = [name for name in names if types.get(name)]
    if not names:
        return model
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {value.name for value in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, types[name], None)
                              for name in names if name not in existing)
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        runs = [session.run(names, feed) for feed in feeds]
    except Exception:  # noqa: BLE001 - ORT cannot run it: onnxslim folds as before
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
