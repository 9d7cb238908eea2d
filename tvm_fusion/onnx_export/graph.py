"""What the exporter reads the simplified graph through: its producers, consumers, folded
constants and shapes (``GraphIndex``), the nodes of one fusion (``Region``), node attributes
(a Resize's among them), and the one way a ``tvm_fusion`` node is written (``fused_node``).

Kept apart from the builders so that each builder reads the graph the same way, and a
builder that cannot express a fusion says why with ``Unrepresentable``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from .reference_ops import DOMAIN
from .standard_ops import RESIZE_ATTRIBUTES, standard_evaluator


class Unrepresentable(Exception):
    """This fusion's nodes cannot become one fused node; the message says why."""


class GraphIndex:
    """Producers, consumers, constants and shapes of the simplified graph.

    Shapes and constants come from one run of the graph under onnx.reference on ``inputs``
    (with ``standard_ops``' corrections, as ``--check`` runs it): onnxslim leaves some shape
    arithmetic unfolded (GPT-2's later layers compute the score scale from a shape), and ONNX
    shape inference loses the shapes after it.
    """

    def __init__(self, model: onnx.ModelProto, inputs: dict[str, np.ndarray]):
        self.model = model
        self.nodes = list(model.graph.node)
        self.producer = {out: i for i, node in enumerate(self.nodes) for out in node.output if out}
        with np.errstate(over="ignore", invalid="ignore"):  # masks of -3.4e38 overflow to -inf, as in ORT
            values = standard_evaluator(model).run(None, inputs, intermediate=True)
        self.values = {name: np.asarray(value) for name, value in values.items()
                       if name and isinstance(value, np.ndarray | np.generic)}
        self.shapes = {name: value.shape for name, value in self.values.items()}
        initializers = {t.name for t in model.graph.initializer}
        constant = set(initializers)
        self.folded: set[int] = set()  # nodes computing constants: their outputs become initializers
        for index, node in enumerate(self.nodes):
            if node.op_type in ("Constant", "Shape", "Size") or (  # shapes are bound: Shape is constant
                    node.input and all(not i or i in constant for i in node.input)
                    and not node.op_type.startswith("Random") and node.op_type != "Dropout"):
                constant.update(o for o in node.output if o in self.values)
                self.folded.add(index)
        self.constants = {name: self.values[name] for name in constant if name in self.values}
        self.folded_tensors = constant - initializers
        self.graph_outputs = {o.name for o in model.graph.output}
        self.live = self._live_indices()
        self.consumers: dict[str, list[int]] = collections.defaultdict(list)
        for i in sorted(self.live):
            for name in self.nodes[i].input:
                self.consumers[name].append(i)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def _live_indices(self) -> set[int]:
        """The nodes the graph outputs depend on, constant ones folded. onnxslim leaves some
        shape arithmetic and dead ends (GPT-2's key transposes read only by a Shape); TVM folds
        and drops them, so do we: a fused node need not output what only they read."""
        needed = set(self.graph_outputs)
        live = set()
        for index in reversed(range(len(self.nodes))):
            node = self.nodes[index]
            if index not in self.folded and needed & set(node.output):
                live.add(index)
                needed.update(node.input)
        return live

    def value_info(self, name: str) -> onnx.ValueInfoProto | None:
        value = self.values.get(name)
        if value is None or value.dtype == object:
            return None
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)

    def scalar(self, name: str) -> float | None:
        value = self.constants.get(name)
        return float(value.reshape(())) if value is not None and value.size == 1 else None

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise Unrepresentable(f"tensor {name!r} has no static shape")
        return self.shapes[name]


class Region:
    """The ONNX nodes one fusion absorbed, and which of the tensors they produce are read outside it."""

    def __init__(self, graph: GraphIndex, indices: Sequence[int]):
        self.graph = graph
        self.indices = sorted(indices)
        self.members = set(indices)
        self.nodes = [graph.nodes[i] for i in self.indices]
        self.outputs = [out for node in self.nodes for out in node.output if out and (
            out in graph.graph_outputs or any(c not in self.members for c in graph.consumers[out]))]

    def producer(self, name: str, op_type: str | None = None) -> onnx.NodeProto | None:
        """The node inside the region that produces ``name`` (of ``op_type``, if given)."""
        index = self.graph.producer.get(name)
        if index not in self.members:
            return None
        node = self.graph.nodes[index]
        return node if op_type is None or node.op_type == op_type else None

    def only(self, *op_types: str) -> onnx.NodeProto:
        found = [n for n in self.nodes if n.op_type in op_types]
        if len(found) != 1:
            raise Unrepresentable(f"expected one {'/'.join(op_types)} node, found {len(found)}")
        return found[0]

    def inside_consumers(self, name: str, done: set[int]) -> list[int]:
        return [i for i in self.graph.consumers[name] if i in self.members and i not in done]

    def single_consumer(self, name: str, op_type: str) -> onnx.NodeProto:
        """The one node inside the region that reads ``name``, which must be an ``op_type``."""
        consumers = self.inside_consumers(name, set())
        if len(consumers) != 1 or self.graph.nodes[consumers[0]].op_type != op_type:
            raise Unrepresentable(f"{name!r} is not read by exactly one {op_type} inside the fusion")
        return self.graph.nodes[consumers[0]]


def attribute(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            value = helper.get_attribute_value(attr)
            return value.decode() if isinstance(value, bytes) else value
    return default


def node_attributes(node: onnx.NodeProto) -> dict:
    return {attr.name: attribute(node, attr.name) for attr in node.attribute}


def fused_node(op_type: str, inputs: list[str], outputs: list[str], **attributes) -> onnx.NodeProto:
    """A ``tvm_fusion`` node; None attributes left out, trailing absent inputs dropped."""
    while inputs and not inputs[-1]:
        inputs = inputs[:-1]
    return helper.make_node(op_type, inputs, outputs, domain=DOMAIN,
                            **{k: v for k, v in attributes.items() if v is not None})


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
