"""An example model's ONNX initializers under the parameter names of its torch module
(torch_models.py), so the GPU check's torch baselines run with the very weights of the artifact.

The TorchScript exporter keeps a parameter's own name (``model.`` prefix and all), except for a
Linear weight that constant folding transposed: that one becomes ``onnx::MatMul_<n>``, the
right operand of a MatMul whose result an Add takes together with the Linear's (named) bias.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

PREFIX = "model."  # the exporter's wrapper (_LastHidden in scripts/export_examples.py)


def _renamed_linear_weights(graph: onnx.GraphProto, initializers: set[str]) -> dict[str, str]:
    """``onnx::MatMul_<n>`` -> the ``...weight`` name of the Linear its bias Add names."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    renamed = {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in initializers or \
                not node.input[1].startswith("onnx::"):
            continue
        biases = [name for add in consumers.get(node.output[0], []) if add.op_type == "Add"
                  for name in add.input if name in initializers and name.endswith(".bias")]
        if len(biases) != 1:
            raise ValueError(f"MatMul weight {node.input[1]} is not followed by one bias Add")
        renamed[node.input[1]] = biases[0][:-len(".bias")] + ".weight"
    return renamed


def torch_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Parameter name -> float32 array, as the torch module's ``load_state_dict`` takes it."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    renamed = _renamed_linear_weights(graph, set(initializers))
    weights = {}
    for name, init in initializers.items():
        value = numpy_helper.to_array(init)
        if name in renamed:
            name, value = renamed[name], value.T  # MatMul's [in, out] back to Linear's [out, in]
        elif name.startswith("onnx::"):
            continue  # a folded constant, not a parameter
        if name.startswith(PREFIX):
            name = name[len(PREFIX):]
        weights[name] = np.ascontiguousarray(value)
    return weights
