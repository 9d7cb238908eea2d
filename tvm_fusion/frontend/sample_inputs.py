"""Seeded inputs valid for a model: floats from a normal, indices inside the table they index.

The tables are found on the ONNX graph (an input gathered from an initializer, through views);
the compiled artifact checks its index inputs against the same tables, as TVM gathers without
a bounds check.
"""

from __future__ import annotations

import collections

import ml_dtypes  # noqa: F401 - registers "bfloat16" as a numpy dtype name
import numpy as np
import onnx

from .input_binding import FLOAT_DTYPES, TensorSpec, graph_inputs


def random_inputs(model: onnx.ModelProto, inputs: list[TensorSpec], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs that are valid for the model: indices stay inside the table they index,
    and a pinned input holds its value."""
    rng = np.random.default_rng(seed)
    index_limits = {name: rows for name, (_table, rows) in index_tables(model).items()}
    values = {}
    for spec in inputs:
        if spec.value is not None:
            value = np.full(spec.shape, spec.value, spec.dtype)
        elif spec.dtype in FLOAT_DTYPES:
            value = rng.standard_normal(spec.shape).astype(spec.dtype)
        elif spec.dtype == "bool":
            value = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            value = rng.integers(0, index_limits.get(spec.name, 2), spec.shape).astype(spec.dtype)
        values[spec.name] = np.asarray(value)  # a scalar input (shape ()) is a 0-d array, not a numpy scalar
    return values


VIEW_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity")


def index_tables(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """Input name -> (initializer, rows) of the smallest table it indexes (token ids, positions),
    seen through views. TVM gathers without a bounds check: the runtime checks these instead."""
    rows = {init.name: init.dims[0] for init in model.graph.initializer if init.dims}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    limits = {}
    for value in graph_inputs(model):
        frontier, seen = [value.name], set()
        while frontier:
            tensor = frontier.pop()
            seen.add(tensor)
            for node in consumers[tensor]:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if (node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == tensor
                        and node.input[0] in rows and axis == 0):
                    table = (node.input[0], rows[node.input[0]])
                    limits[value.name] = min(limits.get(value.name, table), table, key=lambda t: t[1])
                elif node.op_type in VIEW_OPS and node.input[0] == tensor:
                    frontier.extend(out for out in node.output if out not in seen)
    return limits
