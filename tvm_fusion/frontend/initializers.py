"""Model copies that leave the large initializers out, for the steps that never read them.

A model's weights are most of its bytes, and simplifying it copies the model several times:
a probe for ONNX Runtime, onnxslim's graph (every initializer as a numpy array, then a new
protobuf). None of them needs a weight's values: ORT probes compute shape values, and onnxslim
folds nothing larger than ``_FOLDED_BYTES`` (``onnx.py``). So the probe keeps only the
initializers its nodes read, and onnxslim sees each large initializer as a graph input of the
same type and shape; the simplified graph gets the original tensors back by name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The tensor's size in memory, from its type and dims (whatever field holds the data)."""
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):  # a type numpy cannot hold (string, 4-bit): count it small
        return 0
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def copy_with_initializers(model: onnx.ModelProto, keep: Callable[[onnx.TensorProto], bool]) -> onnx.ModelProto:
    """A copy of ``model`` whose top-level graph holds only the initializers ``keep`` accepts;
    the others are never copied (``CopyFrom`` of the whole model would copy every weight)."""
    graph = onnx.GraphProto()
    for field, value in model.graph.ListFields():
        if field.name == "initializer":
            graph.initializer.extend(init for init in value if keep(init))
        else:
            _copy_field(graph, field, value)
    copy = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            copy.graph.CopyFrom(graph)
        else:
            _copy_field(copy, field, value)
    return copy


def _copy_field(message, field, value) -> None:
    if field.is_repeated:
        getattr(message, field.name).extend(value)
    elif field.message_type is not None:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def large_initializers_as_inputs(model: onnx.ModelProto, threshold: int,
                                 keep: frozenset[str] = frozenset()) -> tuple[onnx.ModelProto, set[str]]:
    """A copy in which each top-level initializer over ``threshold`` bytes, except those named
    in ``keep``, is a graph input of its type and shape instead; and the names of those."""
    large = {init.name for init in model.graph.initializer if tensor_bytes(init) > threshold} - keep
    if not large:
        return model, large
    stripped = copy_with_initializers(model, lambda init: init.name not in large)
    declared = {value.name for value in stripped.graph.input}  # IR < 4 lists initializers as inputs too
    stripped.graph.input.extend(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                                for init in model.graph.initializer if init.name in large - declared)
    return stripped, large


def restore_initializers(simplified: onnx.ModelProto, model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """``simplified`` (in place) with the initializers ``names`` of ``model`` back, those it still
    reads, and no longer graph inputs (as onnxslim leaves an initializer an old model listed)."""
    if not names:
        return simplified
    read = {value.name for value in simplified.graph.input} & names
    kept = [value for value in simplified.graph.input if value.name not in read]
    del simplified.graph.input[:]
    simplified.graph.input.extend(kept)
    simplified.graph.initializer.extend(init for init in model.graph.initializer if init.name in read)
    return simplified


def read_initializers(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> set[str]:
    """The top-level initializers that ``nodes`` (and their subgraphs) read."""
    names = {init.name for init in model.graph.initializer}
    return {name for node in nodes for name in node_reads(node) if name in names}


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The names ``node`` reads: its inputs, and every name its subgraphs' nodes read (those
    the subgraph computes itself are not in the outer graph, so they match no producer)."""
    names = list(node.input)
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
            names += [name for inner in graph.node for name in node_reads(inner)]
    return names


# The doc string of an initializer whose data was left out (``elide_large_weights``).
ELIDED = "tvm_fusion: data elided, the original model holds it"


def elide_large_weights(simplified: onnx.ModelProto, model: onnx.ModelProto, threshold: int) -> onnx.ModelProto:
    """A copy of ``simplified`` whose large initializers that are ``model``'s own (same name and
    bytes) keep their name, type and shape but not their data: what reads the simplified graph
    after import wants its structure, and ``restore_weights`` puts the data back for the rest."""
    originals = {init.name: init for init in model.graph.initializer if tensor_bytes(init) > threshold}
    shared = {init.name for init in simplified.graph.initializer
              if init.name in originals and init == originals[init.name]}
    if not shared:
        return simplified
    light = copy_with_initializers(simplified, lambda init: init.name not in shared)
    light.graph.initializer.extend(onnx.TensorProto(name=name, data_type=originals[name].data_type,
                                                    dims=originals[name].dims, doc_string=ELIDED)
                                   for name in sorted(shared))
    return light


def restore_weights(light: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """``light`` (from ``elide_large_weights``) with its elided initializers' data taken from ``model``."""
    elided = {init.name for init in light.graph.initializer if init.doc_string == ELIDED}
    if not elided:
        return light
    whole = copy_with_initializers(light, lambda init: init.name not in elided)
    whole.graph.initializer.extend(init for init in model.graph.initializer if init.name in elided)
    return whole
