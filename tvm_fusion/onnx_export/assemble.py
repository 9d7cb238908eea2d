"""Graph surgery: each fusion's absorbed nodes replaced by what its builder wrote, in graph
order, and the whole checked by onnx.checker.

Each pattern's builder comes from the pattern registry (``registry.builders``). A fusion no
builder can express keeps its original nodes (``KeptInstance``, with why), so the file always
computes what the model did. Builders only describe nodes; placing them, dropping dead ones
and keeping the file valid (initializers, value_info, the opset) is here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..files import write_file
from .graph import GraphIndex, Region, Unrepresentable
from .reference_ops import DOMAIN
from .registry import builders


@dataclasses.dataclass
class KeptInstance:
    variant: str
    nodes: list[str]
    reason: str


@dataclasses.dataclass
class FusedOnnx:
    model: onnx.ModelProto
    fused: dict[str, int]  # fused op type -> nodes written
    kept: list[KeptInstance]


def fused_onnx(model: onnx.ModelProto, instances: Sequence, inputs: dict[str, np.ndarray]) -> FusedOnnx:
    """The simplified ``model`` with each of ``instances`` (api.FusedNodes) as one fused node;
    ``inputs``: values to run the graph on once, for its shapes and folded constants."""
    graph = GraphIndex(model, inputs)
    kept: list[KeptInstance] = []
    replacements: dict[int, list[onnx.NodeProto]] = {}
    claimed: set[int] = set()
    builder_of = builders()
    uses = collections.Counter(i for instance in instances for i in set(instance.indices))
    for number, instance in enumerate(instances):
        if not instance.indices:
            continue
        is_rewrite = instance.variant == instance.pattern
        if is_rewrite and len(instance.indices) == 1:
            continue  # one ONNX node already (Clip, inference Dropout)
        try:
            if len(instance.indices) == 1 and uses[instance.indices[0]] > 1:
                node = graph.nodes[instance.indices[0]]
                raise Unrepresentable(f"one of {uses[instance.indices[0]]} fusions inside the ONNX {node.op_type} "
                                      f"node {node.name!r} (its import is several ops): it stays one node")
            if claimed & set(instance.indices):  # claimed: by a fusion exported already
                raise Unrepresentable("shares nodes with another fusion" + (
                    ", which is exported: the rewrite's other nodes stay as they are" if is_rewrite else ""))
            builder = builder_of.get(instance.pattern)
            if builder is None:
                raise Unrepresentable(f"no fused ONNX op for {instance.pattern}")
            region = Region(graph, instance.indices)
            nodes = builder(region, instance.variant)
            produced = {o for node in nodes for o in node.output}
            missing = [o for o in region.outputs if o not in produced]
            if missing:
                raise Unrepresentable(f"{missing[0]!r} is read outside the fusion but is not a fused op output")
        except Unrepresentable as reason:
            kept.append(KeptInstance(instance.variant, list(instance.nodes), str(reason)))
            continue
        absorbed = "absorbed ONNX nodes: " + ", ".join(
            f"{graph.nodes[i].name or f'#{i}'} ({graph.nodes[i].op_type})" for i in instance.indices)
        for node in nodes:
            if node.domain == DOMAIN:
                node.name = f"{instance.variant}/{graph.nodes[instance.indices[-1]].name or instance.indices[-1]}"
                node.doc_string = f"{instance.variant}: {absorbed}"
        replacements[number] = nodes
        claimed |= set(instance.indices)
    while (late := _out_of_order(graph, instances, replacements)) is not None:
        kept.append(KeptInstance(instances[late].variant, list(instances[late].nodes),
                                 "an input of the fused node is produced after its last absorbed node"))
        del replacements[late]
    nodes = _assemble(graph, instances, replacements)
    fused = _model_with(model, graph, nodes)
    onnx.checker.check_model(fused)
    return FusedOnnx(fused,
                     dict(collections.Counter(n.op_type for n in nodes if n.domain == DOMAIN).most_common()),
                     kept)


def _assemble(graph: GraphIndex, instances, replacements) -> list[onnx.NodeProto]:
    """The graph's nodes in order, each replaced fusion's nodes at its last absorbed node."""
    owner = {i: number for number in replacements for i in instances[number].indices}
    nodes = []
    for index, node in enumerate(graph.nodes):
        number = owner.get(index)
        if number is None:
            if index in graph.live:
                nodes.append(node)
        elif index == instances[number].indices[-1]:
            nodes.extend(replacements[number])
    return nodes


def _out_of_order(graph: GraphIndex, instances, replacements) -> int | None:
    """A fusion whose node would read a tensor before it is produced (or be read before), or None."""
    available = {"", *(i.name for i in graph.model.graph.input), *(t.name for t in graph.model.graph.initializer),
                 *graph.folded_tensors}
    made_by = {o: number for number, nodes in replacements.items() for node in nodes for o in node.output}
    owner = {id(node): number for number, nodes in replacements.items() for node in nodes}
    for node in _assemble(graph, instances, replacements):
        for name in node.input:
            if name not in available:
                return owner.get(id(node), made_by.get(name))
        available.update(node.output)
    return None


def _model_with(model: onnx.ModelProto, graph: GraphIndex, nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    """``model`` with ``nodes``, the ``tvm_fusion`` opset, and only the initializers still read."""
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    del fused.graph.node[:]
    fused.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input} | graph.graph_outputs
    kept_initializers = [t for t in model.graph.initializer if t.name in used]
    kept_initializers += [numpy_helper.from_array(graph.values[name], name)
                          for name in sorted(graph.folded_tensors & used)]
    del fused.graph.initializer[:]
    fused.graph.initializer.extend(kept_initializers)
    produced = {o for node in nodes for o in node.output}
    del fused.graph.value_info[:]
    fused.graph.value_info.extend(info for info in map(graph.value_info, sorted(produced - graph.graph_outputs))
                                  if info is not None)
    for output in fused.graph.output:  # an untyped output fails onnx.checker
        if not output.type.tensor_type.elem_type and (info := graph.value_info(output.name)) is not None:
            output.CopyFrom(info)
    if not any(o.domain == DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    fused.graph.doc_string = ("tvm_fusion: each tvm_fusion-domain node is one fused kernel; "
                              "its doc_string lists the ONNX nodes it absorbed")
    return fused


def write_model(model: onnx.ModelProto, path: str | Path) -> Path:
    """``model`` saved atomically (no half-written file if the disk fills or the run is killed)."""
    return write_file(path, lambda staging: onnx.save(model, str(staging)), "the fused ONNX file", "--onnx")
